"""Tokenizers: the byte tokenizer, and chat templates rendered in a sandbox."""

import datetime
import json
import os
import re

import pytest

from eprt.model.tokenizer import ByteTokenizer, Tokenizer


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, experts")
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids + [tok.EOS]) == "héllo, experts"


def test_template_refusal_is_a_value_error_with_its_message():
    tok = Tokenizer(
        None,
        [],
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}"
        "[{{ m['content'] }}]{% endfor %}",
    )
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"
    with pytest.raises(ValueError, match="system messages are not supported"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_runs_sandboxed():
    from jinja2.exceptions import SecurityError

    tok = Tokenizer(None, [], "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_no_template_is_a_clear_error():
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(None, []).apply_chat_template([{"role": "user", "content": "hi"}])


# ---- fidelity with transformers: chat templates and special tokens ------------------------------------

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

QWEN3 = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    '    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}\n'
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- set content = message.content if message.content is string else '' %}\n"
    '    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if '</think>' in content %}\n"
    "            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index and reasoning_content %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of "
    "an initial optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

# loopcontrols ({% break %}, {% continue %}), strftime_now, tojson with HTML characters, {% generation %}
TOOLS_STYLE = (
    "{{ bos_token }}Today is {{ strftime_now('%Y') }}.\n"
    "{% for message in messages %}\n"
    "  {% if message.role == 'system' %}{% continue %}{% endif %}\n"
    "  {% if loop.index0 >= 6 %}{% break %}{% endif %}\n"
    "  {% if message.role == 'assistant' %}{% generation %}<a>{{ message.content }}</a>{% endgeneration %}\n"
    "  {% else %}<{{ message.role }}>{{ message | tojson }}\n"
    "  {% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<a>{% endif %}"
)

TEMPLATES = {"llama3": LLAMA3, "qwen3": QWEN3, "mistral": MISTRAL, "loopcontrols_strftime": TOOLS_STYLE}

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say <b>'hi'</b> & \"bye\""}],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nuno"},
        {"role": "user", "content": "two"},
    ],
    [
        {"role": "user", "content": f"m{i}"} if i % 2 == 0 else {"role": "assistant", "content": f"r{i}"}
        for i in range(9)
    ],
]

SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "[INST]",
    "[/INST]",
    "<think>",
    "</think>",
]


def _words():
    text = " ".join(" ".join(m["content"] for m in chat) for chat in CHATS)
    words = (
        "hello there you are terse say hi bye one two uno hmm today is cutting knowledge date december "
        "system user assistant the a of".split()
    )
    return words + sorted({w for w in text.lower().split()} - set(words))


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory):
    """A Mixtral/Llama-style tokenizer (the post-processor prepends <s>), saved by transformers 5.x:
    tokenizer.json, tokenizer_config.json and chat_template.jinja. ids: <pad>=0 <s>=1 </s>=2 <unk>=3."""
    import transformers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in [chr(c) for c in range(33, 127)] + _words():
        vocab.setdefault(ch, len(vocab))
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.chat_template = MISTRAL
    out = tmp_path_factory.mktemp("bos-tokenizer")
    fast.save_pretrained(out)
    assert len(vocab) <= 256  # fits the tiny checkpoints' vocabulary
    return str(out)


def _eprt_tokenizer(path, template=None):
    import types

    from eprt.model.tokenizer import load_tokenizer

    tok = load_tokenizer(path, types.SimpleNamespace(eos_token_ids=(2,)))
    if template is not None:
        tok.chat_template, tok._compiled = template, None
    return tok


def _hf_tokenizer(path, template=None):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if template is not None:
        tok.chat_template = template
    return tok


def test_transformers_5_saves_chat_template_jinja_and_it_is_read(bos_tokenizer_dir):
    assert os.path.isfile(os.path.join(bos_tokenizer_dir, "chat_template.jinja"))
    with open(os.path.join(bos_tokenizer_dir, "tokenizer_config.json")) as f:
        assert "chat_template" not in json.load(f)
    tok = _eprt_tokenizer(bos_tokenizer_dir)
    assert tok.chat_template == MISTRAL
    assert tok.apply_chat_template(CHATS[0]).startswith("<s> [INST] Hello there [/INST]")


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(bos_tokenizer_dir, name, chat, add_generation_prompt):
    ours = _eprt_tokenizer(bos_tokenizer_dir, TEMPLATES[name])
    theirs = _hf_tokenizer(bos_tokenizer_dir, TEMPLATES[name])
    messages = CHATS[chat]
    try:
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as refused:  # the Mistral template's role checks
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == want
    want_ids = theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours.encode(text) == want_ids  # what the server does with it
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == want_ids
    if "bos_token" in TEMPLATES[name]:
        assert want_ids[:2] == [1, want_ids[1]] and want_ids.count(1) == 1  # BOS exactly once


def test_mistral_template_refuses_roles_out_of_order(bos_tokenizer_dir):
    tok = _eprt_tokenizer(bos_tokenizer_dir)
    with pytest.raises(ValueError, match="conversation roles must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}])


def test_tojson_does_not_escape_html_and_strftime_now_is_today():
    tok = Tokenizer(
        None, [], "{{ strftime_now('%Y-%m') }}|{{ messages[0] | tojson }}|{{ messages[0].content | tojson(indent=2) }}"
    )
    got = tok.apply_chat_template([{"role": "user", "content": "<b>'x'</b> & é"}])
    month = datetime.date.today().strftime("%Y-%m")
    assert got == f'{month}|{{"role": "user", "content": "<b>\'x\'</b> & é"}}|"<b>\'x\'</b> & é"'


def test_namespace_refuses_underscore_attributes():
    from jinja2.exceptions import SecurityError

    tok = Tokenizer(None, [], "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "text", ["Hello there", "say hi , bye", "<s> hello", "<s><s> one", "hello <s> two", "unknown words here"]
)
def test_text_prompts_are_encoded_as_transformers_does(bos_tokenizer_dir, text):
    ours, theirs = _eprt_tokenizer(bos_tokenizer_dir), _hf_tokenizer(bos_tokenizer_dir)
    want = theirs(text)["input_ids"]
    got = ours.encode(text)
    assert got[0] == 1  # the tokenizer's own BOS
    if text.startswith("<s>"):  # transformers doubles it; eprt does not
        assert want[:2] == [1, 1] and got == want[1:]
    else:
        assert got == want


def test_tokenizer_config_template_forms(tmp_path):
    import types

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from eprt.model.tokenizer import TokenizerFileError, load_tokenizer

    HFTokenizer(models.WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    cfg = types.SimpleNamespace(eos_token_ids=())
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})
    )
    assert load_tokenizer(str(tmp_path), cfg).chat_template == "D"
    config.write_text(json.dumps({"chat_template": "S"}))
    assert load_tokenizer(str(tmp_path), cfg).chat_template == "S"
    (tmp_path / "chat_template.jinja").write_text("J")  # takes priority, as in transformers
    assert load_tokenizer(str(tmp_path), cfg).chat_template == "J"
    (tmp_path / "chat_template.jinja").unlink()
    config.write_text(json.dumps({"chat_template": 5}))
    with pytest.raises(TokenizerFileError, match="'chat_template' must be a string or a list"):
        load_tokenizer(str(tmp_path), cfg)
    config.write_text("{oops")
    with pytest.raises(TokenizerFileError, match=r"tokenizer_config\.json is not valid JSON"):
        load_tokenizer(str(tmp_path), cfg)


def test_greedy_text_prompt_outputs_equal_transformers_with_a_bos_tokenizer(checkpoint, bos_tokenizer_dir, tmp_path):
    """End to end: `eprt generate --prompt TEXT` vs transformers' tokenizer(TEXT) + generate."""
    import subprocess
    import sys

    import torch
    from checkpoints import load_reference

    model = tmp_path / "model"
    model.mkdir()
    for directory in (checkpoint("mixtral"), bos_tokenizer_dir):
        for name in os.listdir(directory):
            os.symlink(os.path.join(directory, name), model / name)
    prompts = ["Hello there , you are terse", "say hi and bye ! one two"]
    hf_tok, hf_model = _hf_tokenizer(str(model)), load_reference(str(model))
    want = []
    for text in prompts:
        ids = hf_tok(text, return_tensors="pt")["input_ids"]
        assert ids[0, 0].item() == 1
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        want.append({"prompt_ids": ids[0].tolist(), "token_ids": out[0, ids.shape[1] :].tolist()})
    cmd = [sys.executable, "-m", "eprt", "generate", "--model", str(model), "--max-tokens", "12", "--json"]
    for text in prompts:
        cmd += ["--prompt", text]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [{"prompt_ids": g["prompt_ids"], "token_ids": g["token_ids"]} for g in got] == want


def test_the_servers_chat_path_gives_transformers_ids(bos_tokenizer_dir):
    """/v1/chat/completions renders with apply_chat_template and encodes the result: BOS once, as transformers."""
    import types

    from eprt.serve.openai import _chat_prompt

    engine = types.SimpleNamespace(tokenizer=_eprt_tokenizer(bos_tokenizer_dir))
    messages = CHATS[2]
    want = _hf_tokenizer(bos_tokenizer_dir).apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert _chat_prompt(messages, engine) == want and want.count(1) == 1
