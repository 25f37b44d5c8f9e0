"""The text pipeline: the tokenizer the served checkpoint ships (`tokenizer`), streaming
detokenization and stop strings (`detok`), chat templates (`chat`) and grammars that bind the
tokens a request may take (`grammar`)."""
