"""Text <-> token ids and nothing else: the `Tokenizer`, its GGUF vocabulary (`gguf_vocab`), chat templates
rendered in a sandbox (`chat_template`), a disk cache of GGUF-built tokenizers (`cache`) and the streaming
detokenizer (`detokenizer`, which depends on the tokenizer, never the reverse).
"""
