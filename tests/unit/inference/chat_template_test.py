"""Chat templates rendered with jinja2 the way transformers renders them (expected texts written out by hand)."""

import pytest

from maxtext.inference.chat_template import ChatTemplateError, render_chat_template

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chatml_with_a_generation_prompt():
  text = render_chat_template(CHATML, [{"role": "user", "content": "Hi?"}])
  assert (
      text == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
  )
  without = render_chat_template(CHATML, [{"role": "user", "content": "Hi?"}], add_generation_prompt=False)
  assert without == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"


def test_bos_eos_trim_blocks_and_tojson():
  template = (
      "{{ bos_token }}\n{% for m in messages %}\n  {% if m %}{{ m['content'] | tojson }}{% endif %}{{ eos_token }}\n"
      "{% endfor %}"
  )
  text = render_chat_template(template, [{"role": "user", "content": 'é"x'}], bos_token="<s>", eos_token="</s>")
  assert text == '<s>\n"é\\"x"</s>\n'  # blocks trimmed and lstripped; tojson keeps non-ASCII


def test_no_template_is_a_clear_error():
  with pytest.raises(ChatTemplateError, match="use_chat_template=true but /m/tok.json has no chat template"):
    render_chat_template(None, [{"role": "user", "content": "x"}], source="/m/tok.json")


@pytest.mark.parametrize(
    "template, messages, match",
    [
        ("{{ raise_exception('only user turns') }}", [{"role": "user", "content": "x"}], "raised: only user turns"),
        ("{% for %}", [{"role": "user", "content": "x"}], "does not parse"),
        ("{{ missing.attribute }}", [{"role": "user", "content": "x"}], "failed to render"),
        ("{{ 1 }}", [{"content": "x"}], r"messages\[0\] must be a mapping with a 'role' string"),
        ("{{ 1 }}", [{"role": "user", "content": 3}], r"messages\[0\] must have a 'content' string"),
    ],
)
def test_template_and_message_errors(template, messages, match):
  with pytest.raises(ChatTemplateError, match=match):
    render_chat_template(template, messages)


def test_strftime_now_is_available():
  assert len(render_chat_template("{{ strftime_now('%Y') }}", [])) == 4
