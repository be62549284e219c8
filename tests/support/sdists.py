"""A minimal sdist (PKG-INFO + setup.py) written by hand: building one needs no network."""

from __future__ import annotations

import io
import tarfile


def sdist_bytes(name: str, setup_py: str, version: str = "0.1") -> bytes:
    """The .tar.gz of `name`-`version` holding only PKG-INFO and `setup_py`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        files = {"PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", "setup.py": setup_py}
        for fname, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{fname}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
