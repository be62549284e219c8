"""webutil: small helpers for the CMS."""
