"""todo: a tiny command-line task list."""
__version__ = "0.4.1"
