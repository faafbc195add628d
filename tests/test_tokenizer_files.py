"""Which tokenizer files a model folder needs: none is one clear error, a SentencePiece model alone
(tokenizer.model, as Llama 2-era repos ship it) is converted to a fast tokenizer."""

import json

import pytest
import sentencepiece

from pagedllm.tokenizer import load_tokenizer

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Hello world, this is a small tokenizer for a test.",
]


def _config_only(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def test_folder_without_tokenizer_files_names_them(tmp_path):
    folder = _config_only(tmp_path / "model")
    with pytest.raises(FileNotFoundError) as error:
        load_tokenizer(folder)
    message = str(error.value)
    assert str(folder) in message
    assert "tokenizer.json" in message and "tokenizer_config.json" in message
    assert "tokenizer.model" in message and "--tokenizer" in message
    assert "sentencepiece" not in message


def test_sentencepiece_model_alone_loads_as_a_fast_tokenizer(tmp_path):
    folder = _config_only(tmp_path / "model")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT * 10),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=64,
        model_type="bpe",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (folder / "tokenizer.vocab").unlink()
    processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))

    tokenizer = load_tokenizer(folder)

    assert tokenizer.is_fast
    for text in [*TEXT, "Values in a brown box."]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert ids == processor.encode(text)
        assert tokenizer.decode(ids) == processor.decode(ids)
