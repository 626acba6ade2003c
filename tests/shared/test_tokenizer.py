"""The tokenizer built from GGUF metadata (or a HF dir) matches Hugging Face transformers'."""
import subprocess
import sys

import pytest

from shared.model_source import resolve_model
from shared.tokenizer import load_tokenizer

TEXTS = [
    "Hello world! 12345 héllo  spaces",
    "def f(x):\n    return x**2  # ok\n\n\n",
    "日本語のテキスト 🤖 emoji",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  leading and trailing  ",
    "3.14159 and 1,000,000",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    src = resolve_model(None)
    return AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_encodes_and_decodes_like_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_renders_like_transformers(ours, reference, messages):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert ours.encode_chat(messages) == reference.encode(expected, add_special_tokens=False)


def test_smollm2_stops_at_end_of_turn(ours):
    assert ours.convert_ids_to_tokens(ours.eos_token_ids) == ["<|im_end|>"]


def test_hf_directory_tokenizer_matches_transformers(reference, tmp_path):
    reference.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"eos_token_id": 0}')
    tok = load_tokenizer(resolve_model_dir(tmp_path))
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text)
    assert tok.apply_chat_template(CHATS[1]) == reference.apply_chat_template(
        CHATS[1], tokenize=False, add_generation_prompt=True)
    assert set(tok.eos_token_ids) == {0, 2}  # the config's EOS and the template's end of turn


def resolve_model_dir(path):
    from shared.model_source import ModelSource

    return ModelSource("hf", path, path.name)


def test_loading_the_tokenizer_does_not_import_torch():
    code = ("import sys; from shared.tokenizer import load_tokenizer; from shared.model_source import resolve_model;"
            "load_tokenizer(resolve_model(None)); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
