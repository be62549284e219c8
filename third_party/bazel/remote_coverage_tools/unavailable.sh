#!/bin/sh
echo "bazel coverage is not available offline (see docs/bazel.md)" >&2
exit 1
