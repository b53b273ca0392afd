"""Tokenizers: the byte tokenizer, and chat templates rendered in a sandbox."""
import pytest

from eprt.model.tokenizer import ByteTokenizer, Tokenizer


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("héllo, experts")
    assert all(0 <= i < 256 for i in ids) and tok.decode(ids + [tok.EOS]) == "héllo, experts"


def test_template_refusal_is_a_value_error_with_its_message():
    tok = Tokenizer(None, [], "{% for m in messages %}{% if m['role'] == 'system' %}"
                              "{{ raise_exception('system messages are not supported') }}{% endif %}"
                              "[{{ m['content'] }}]{% endfor %}")
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
