"""Build the testbed's tiny random-weight Llama with a real tokenizer.

Runs inside the vLLM virtual environment (it needs torch). The tokenizer is Mistral-7B v0.1's
32k SentencePiece vocabulary, shipped in the `mistral-common` package, so the gateway and
vLLM both load the very same tokenizer.json and chat template from the model folder.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mistral_common
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

# A ChatML-like template with a system prompt and tool descriptions, so the counting tests
# exercise roles, tools and the generation prompt the way real templates do.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% if documents %}{% for doc in documents %}<|document|>{{ doc | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{% if message.get('tool_calls') %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "{% if not (loop.last and continue_final_message) %}</s>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def find_tokenizer_model() -> Path:
    data = Path(mistral_common.__file__).parent / "data"
    for candidate in sorted(data.rglob("tokenizer.model.v1")):
        return candidate
    raise SystemExit(f"tokenizer.model.v1 not found under {data}")


def main(out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(find_tokenizer_model(), out_dir / "tokenizer.model")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "LlamaTokenizer", "legacy": False})
    )
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    print(out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
