"""A checkpoint's text interface: its tokenizer, its chat template and its tool-call syntax.
`composer-chatml-v1` (`chatml.py`) is the format of the models this project makes itself."""
