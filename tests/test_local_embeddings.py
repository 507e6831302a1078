"""`memory.embedding: local`: a model2vec model from a directory, never from a hub.

The model is built in the test (a word-level tokenizer and a vector per word, saved
with model2vec's own `save_pretrained`), so recall runs a real model2vec model end to
end; without the optional library the model tests are skipped, saying why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from config import GatewayConfig
from gateway.memory.embeddings import LOCAL_MAX_CHARS, LocalEmbedder
from gateway.memory.recall import Namespace, Recall
from gateway.session import Platform, SessionSource
from gateway.store.session_store import SessionStore
from tests.commandline import cli

HAVE_MODEL2VEC = importlib.util.find_spec("model2vec") is not None
needs_model2vec = pytest.mark.skipif(
    not HAVE_MODEL2VEC,
    reason="model2vec is not installed (pip install 'hermes-gateway[local-embeddings]')",
)
ALICE = Namespace.of("main", SessionSource(Platform.HTTP, "c", "dm", user_id="alice"))

# Words of one meaning share a direction: what a trained static model learns.
MEANINGS = {
    0: ["car", "automobile", "vehicle", "parked"],
    1: ["garage", "upstairs", "level"],
    2: ["lunch", "meal", "noon"],
    3: ["sam", "friend"],
}


def build_model(path: Path) -> Path:
    from model2vec import StaticModel
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.normalizers import Lowercase
    from tokenizers.pre_tokenizers import Whitespace

    words = ["[UNK]", "[PAD]"] + [w for group in MEANINGS.values() for w in group]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.normalizer = Lowercase()
    tokenizer.pre_tokenizer = Whitespace()
    vectors = np.zeros((len(words), 8), dtype=np.float32)
    for meaning, group in MEANINGS.items():
        for word in group:
            vectors[words.index(word), meaning] = 1.0
            vectors[words.index(word), 4 + meaning] = 0.1  # near, not equal
    StaticModel(vectors, tokenizer, normalize=True).save_pretrained(path)
    return path


def config_of(**memory: object) -> GatewayConfig:
    return GatewayConfig.model_validate({"memory": memory})


@needs_model2vec
async def test_a_local_model_finds_a_paraphrase_sharing_no_word(tmp_path: Path) -> None:
    model = build_model(tmp_path / "model")
    config = config_of(embedding="local", model_path=str(model), weights={"vector": 1, "text": 0})
    async with SessionStore(tmp_path / "sessions", config) as store:
        recall = Recall(store, config)
        await recall.open()
        car = await recall.save(ALICE, "parked the car in the garage")
        await recall.save(ALICE, "lunch with Sam at noon")
        hits = await recall.search(ALICE, "automobile upstairs", k=2)
        await recall.close()
    assert hits[0].id == car
    assert recall.embedder.model_id.startswith("local:model:")


@needs_model2vec
async def test_a_local_model_embeds_off_the_loop_and_cuts_long_texts(tmp_path: Path) -> None:
    embedder = LocalEmbedder(build_model(tmp_path / "model"))
    short = await embedder.embed(["car " * (LOCAL_MAX_CHARS // 4)])
    longer = await embedder.embed(["car " * (LOCAL_MAX_CHARS // 4) + "lunch " * 10_000])
    assert short.shape == (1, 8)
    np.testing.assert_allclose(short, longer)  # what is past the cut is not looked at


def test_local_without_a_model_path_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"memory\.model_path"):
        config_of(embedding="local")


def test_a_missing_local_model_stops_check_config_with_78(tmp_path: Path) -> None:
    (tmp_path / "hermes.yaml").write_text(
        f"memory:\n  embedding: local\n  model_path: {tmp_path / 'nowhere'}\n"
    )
    result = cli(tmp_path, "check-config")
    assert result.returncode == 78
    assert "memory.model_path: " in result.stderr and "is not a directory" in result.stderr


@needs_model2vec
def test_a_directory_without_a_model_stops_run_with_78(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "hermes.yaml").write_text(
        f"memory:\n  embedding: local\n  model_path: {tmp_path / 'empty'}\n"
    )
    result = cli(tmp_path, "run")
    assert result.returncode == 78
    assert "memory.model_path" in result.stderr + result.stdout
    assert "holds no model2vec model" in result.stderr + result.stdout
