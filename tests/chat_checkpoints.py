"""Tiny chat checkpoints for the reasoning and tool-calling tests: the random qwen3_moe checkpoint
with 320 tokens, a byte-level tokenizer (ids 0..255 are the bytes, so any text, JSON included,
can be written and structured outputs can constrain it) plus the chat families' tags as added
tokens, and a chat template written for the tests in each family's format (Qwen3 with Hermes
tool calls, DeepSeek-V3.1, GLM-4.5, Kimi-K2, Qwen3-Coder). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os

from checkpoints import build_gptoss_checkpoint, building

VOCAB = 320
TAGS = [
    "<|im_start|>",
    "<|im_end|>",  # 257: the EOS
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
]
EOS = 257
SPECIAL = {"<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "[gMASK]", "<sop>"}

# Qwen3 (the thinking-2507 models' generation prefix opens the block; enable_thinking=false
# writes an empty one) with Hermes tool calls
QWEN3 = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

# DeepSeek-V3.1: `thinking` opens the block in the generation prefix, else closes it
DEEPSEEK = """<｜begin▁of▁sentence｜>{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content or '' }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}
<｜tool▁call▁begin｜>{{ tc.function.name }}<｜tool▁sep｜>{{ tc.function.arguments | tojson }}{% if true %}
<｜tool▁call▁end｜>{% endif %}{% endfor %}
<｜tool▁calls▁end｜>{% endif %}
<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>
{%- else %}{{ m.content }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{% if thinking is defined and thinking %}
<think>{% else %}
</think>{% endif %}{% endif %}"""

# GLM-4.5: the model opens its own block (so the tests bias it); tool calls in arg_key/arg_value tags
GLM45 = """[gMASK]<sop>{%- for m in messages %}
{%- if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>
{%- else %}<|{{ m.role }}|>{{ m.content }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}
<think></think>{% endif %}{% endif %}"""

# Kimi-K2 (thinking): the block is opened in the prefix, the tool-call section may end it
KIMI = """{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}
{%- if m.tool_calls %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}
<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>{{ tc.function.arguments | tojson }}{% if true %}
<|tool_call_end|>{% endif %}{% endfor %}
<|tool_calls_section_end|>{% endif %}
<|im_end|>
{%- elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- else %}<|im_user|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|><think>{% endif %}"""

# Qwen3-Coder: XML tool calls, no thinking block
QWEN3_CODER = """{%- for m in messages %}
{%- if m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TEMPLATES = {"qwen3": QWEN3, "deepseek_v3": DEEPSEEK, "glm45": GLM45, "kimi_k2": KIMI, "qwen3_coder": QWEN3_CODER}


HARMONY_TAGS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
HARMONY_EOS = ("<|return|>", "<|call|>")  # gpt-oss's generation_config ends its answers on both

# gpt-oss's harmony format, written for the tests after the format's documentation (not the released
# template): a system message, the developer message (instructions and the functions namespace), the
# turns, an assistant's analysis as ``thinking``, its calls to functions.NAME, the tools' results
HARMONY = """{%- set ns = namespace(tool=none) -%}
<|start|>system<|message|>You are a tiny test model.
Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- set lead = messages[0] if messages and messages[0].role in ('system', 'developer') else none %}
{%- if lead or tools %}<|start|>developer<|message|>{% if lead %}# Instructions

{{ lead.content }}

{% endif %}{% if tools %}# Tools

## functions

namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}} // namespace functions{% endif %}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- for tc in m.tool_calls %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>
{{- tc.function.arguments | tojson }}<|call|>{% set ns.tool = tc.function.name %}{% endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.tool }} to=assistant<|channel|>commentary<|message|>
{{- m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def byte_level_tokenizer(tags=TAGS, special=SPECIAL):
    """A byte-level BPE without merges: every byte one token (ids 0..255), the tags added after."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = pre_tokenizers.ByteLevel.alphabet()
    order = sorted(chars, key=lambda c: _byte_of(c))
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(order)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=t in special, normalized=False) for t in tags])
    return tok


def _byte_of(char: str) -> int:
    """The byte a byte-level BPE character stands for (GPT-2's printable mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    if ord(char) in printable:
        return ord(char)
    return sorted(set(range(256)) - set(printable))[ord(char) - 256]


def build_chat_checkpoint(checkpoint, root: str, family: str) -> str:
    """``root``/``family``: the tiny qwen3_moe checkpoint (VOCAB tokens, EOS <|im_end|>), its
    files linked, plus the byte-level tokenizer and ``family``'s chat template."""
    base = os.path.abspath(checkpoint("qwen3_moe", vocab_size=VOCAB, eos_token_id=EOS, max_position_embeddings=2048))
    out = os.path.join(root, family)
    with building(out, done="chat_template.jinja") as temp:
        if temp is not None:
            for name in os.listdir(base):
                os.symlink(os.path.join(base, name), os.path.join(temp[0], name))
            tok = byte_level_tokenizer()
            assert tok.token_to_id("<|im_end|>") == EOS and tok.get_vocab_size() <= VOCAB
            _write_tokenizer(temp[0], tok, "<|im_end|>", TEMPLATES[family])
    return out


def _write_tokenizer(out: str, tok, eos: str, template: str) -> None:
    """tokenizer.json, a tokenizer_config.json naming ``eos`` (no BOS), and chat_template.jinja last."""
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, "bos_token": None}, f)
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(template)


def build_harmony_checkpoint(root: str) -> str:
    """``root``/gpt_oss-harmony: the tiny gpt_oss checkpoint (320 tokens, EOS <|return|> and <|call|>),
    the byte-level tokenizer with harmony's tags (ids 256..262, all special) and the HARMONY template."""
    out = os.path.join(root, "gpt_oss-harmony")
    with building(out, done="chat_template.jinja") as temp:
        if temp is not None:
            eos = [256 + HARMONY_TAGS.index(t) for t in HARMONY_EOS]
            kw = dict(vocab_size=VOCAB, eos_token_id=eos, max_position_embeddings=1024)
            build_gptoss_checkpoint(temp[0], "bfloat16", **kw)
            _write_tokenizer(temp[0], byte_level_tokenizer(HARMONY_TAGS, set(HARMONY_TAGS)), "<|return|>", HARMONY)
    return out
