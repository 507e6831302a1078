"""Embedding backends: text -> float32 unit vectors (rows of a numpy array).

`hash` (the zero-config default): each word (lowercased, \\w+) is hashed (blake2b) to a
dimension and a sign, and the counts are L2-normalized: the "hashing trick". No model,
deterministic, and lexical: texts score alike when they share words, a paraphrase in
other words does not, and the same text always gives the same vector.
(The seed hashes the whole text to one random vector; hashing words instead keeps the
vector signal from being noise whenever the text is not repeated exactly.)

`openai`: `POST {base_url}/embeddings` on any OpenAI-compatible server (OpenAI, Ollama,
vLLM, llama.cpp), in batches; the vector size is checked once at start (`check`).
The API key goes in the Authorization header only, never in a log line or an error.

`local`: a model2vec static model (the optional extra `local-embeddings`) loaded from the
directory `memory.model_path`, never from a hub; it embeds on a worker thread, each
text cut at LOCAL_MAX_CHARS. A missing library or directory is a ConfigError naming the
key (exit 78).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import numpy as np

from config import ConfigError, GatewayConfig

_WORD = re.compile(r"\w+")
BATCH = 64  # texts per /embeddings request
SLOT_CACHE_WORDS = 500_000  # hash: words whose slot is kept (about 60 MB at most)
INLINE_CHARS = 2_000  # hash: texts up to this size are embedded on the caller's thread
# local: characters of one text the model sees. A static model's cost is linear in the
# tokens, and the index's chunks are at most memory.chunk_size (8,192) characters.
LOCAL_MAX_CHARS = 8_192
LOCAL_LIBRARY = "model2vec"
LOCAL_FILES = ("config.json", "tokenizer.json")  # besides the vectors (*.safetensors)


class EmbeddingError(RuntimeError):
    """The embedding backend failed (unreachable, refused, or a malformed answer)."""


class Embedder(Protocol):
    """What recall and the indexer ask of a backend (`build_embedder` picks one)."""

    #: what the vectors are, stored beside each one: a change re-embeds in the background
    model_id: str
    #: cosine below which a vector match is no candidate (hash: shared-word noise)
    min_similarity: float

    async def check(self) -> None: ...
    async def embed(self, texts: Sequence[str]) -> np.ndarray: ...
    async def close(self) -> None: ...


class HashEmbedder:
    min_similarity = 0.1  # a hash collision of two unrelated words scores ~1/sqrt(dim)

    def __init__(self, dimensions: int = 256) -> None:
        self.dimensions = dimensions
        self.model_id = f"hash-words:{dimensions}"
        # word -> its signed slot (dimension + 1, negative for -1): words repeat (a
        # vocabulary is Zipf-like), and hashing one cost ten times the look-up.
        self._slots: dict[str, int] = {}

    async def check(self) -> None:
        return None

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        if sum(len(text) for text in texts) <= INLINE_CHARS:
            return self.embed_sync(texts)  # a query: not worth a thread hop
        # A batch of chunks: on a thread, so the event loop is not held for its length.
        return await asyncio.to_thread(self.embed_sync, texts)

    def embed_sync(self, texts: Sequence[str]) -> np.ndarray:
        dims, slots = self.dimensions, self._slots
        counts: list[int] = []
        words: list[str] = []
        for text in texts:
            found = _WORD.findall(text.lower())
            counts.append(len(found))
            words.extend(found)
        # The look-ups in one C-level pass; only words never seen are hashed in Python.
        signed = list(map(slots.get, words))
        if None in signed:
            for i, slot in enumerate(signed):
                if slot is None:
                    signed[i] = self._slot(words[i])
        flat = np.zeros(len(texts) * dims, dtype=np.float32)
        if signed:
            at = np.array(signed, dtype=np.int64)
            rows = np.repeat(np.arange(len(texts), dtype=np.int64), counts)
            # Counts per (row, dimension), signed, summed over the cells the words hit
            # only: a bincount over every cell of the batch (rows x dimensions, float64)
            # cost more than the rest of the embedding.
            cells, cell_of_word = np.unique(rows * dims + np.abs(at) - 1, return_inverse=True)
            flat[cells] = np.bincount(cell_of_word, weights=np.sign(at)).astype(np.float32)
        return unit_rows(flat.reshape(len(texts), dims))

    def _slot(self, word: str) -> int:
        """A word's signed slot (dimension + 1, negative for -1), hashed and kept."""
        digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest())
        slot = digest % self.dimensions + 1
        if not digest >> 63:
            slot = -slot
        if len(self._slots) < SLOT_CACHE_WORDS:
            self._slots[word] = slot
        return slot

    async def close(self) -> None:
        return None


class OpenAIEmbedder:
    min_similarity = 0.0

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        dimensions: int | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.url = base_url.rstrip("/") + "/embeddings"
        self.model = model
        self.dimensions = dimensions
        self.model_id = f"openai:{model}" + (f":{dimensions}" if dimensions else "")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def check(self) -> None:
        """Once at start: one request, its vector size pinned (or compared with
        `memory.dimensions`). Raises EmbeddingError."""
        size = (await self.embed(["dimension check"])).shape[1]
        if self.dimensions is None:
            self.dimensions = size  # model_id stays: a start without the server is the same
        elif size != self.dimensions:
            raise EmbeddingError(
                f"{self.url} returned vectors of {size} dimensions for model {self.model!r};"
                f" memory.dimensions says {self.dimensions}"
            )

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        rows: list[np.ndarray] = []
        for start in range(0, len(texts), BATCH):
            rows.append(await self._request(list(texts[start : start + BATCH])))
        if not rows:
            return np.zeros((0, self.dimensions or 0), dtype=np.float32)
        out = np.vstack(rows)
        if self.dimensions is not None and out.shape[1] != self.dimensions:
            raise EmbeddingError(
                f"{self.url} returned {out.shape[1]} dimensions, expected {self.dimensions}"
            )
        return unit_rows(out)

    async def _request(self, texts: list[str]) -> np.ndarray:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        body = {"model": self.model, "input": texts}
        try:
            async with self._session.post(self.url, json=body, headers=self._headers) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:200]
                    raise EmbeddingError(f"{self.url} answered {resp.status}: {detail}")
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise EmbeddingError(f"{self.url}: {type(exc).__name__}: {exc}") from None
        try:
            items = sorted(data["data"], key=lambda item: item["index"])
            out = np.asarray([item["embedding"] for item in items], dtype=np.float32)
        except (KeyError, TypeError, ValueError) as exc:
            raise EmbeddingError(f"{self.url}: malformed answer ({exc})") from None
        if out.ndim != 2 or out.shape[0] != len(texts):
            raise EmbeddingError(f"{self.url}: {len(texts)} texts sent, {out.shape[0]} vectors")
        return out

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class LocalEmbedder:
    """A model2vec model from a directory, run in this process (the module docstring).
    Loading it (tens of MB of vectors) happens on a thread at `check`, not at build."""

    min_similarity = 0.0

    def __init__(self, path: Path) -> None:
        self.path = path
        vectors = sorted(path.glob("*.safetensors"))
        # The directory's name and the vectors' size: another model at the same path
        # is another id, and the index re-embeds for it.
        self.model_id = f"local:{path.name}:{sum(v.stat().st_size for v in vectors)}"
        self._model: Any = None
        self._loading = asyncio.Lock()

    async def check(self) -> None:
        await self._loaded()

    async def _loaded(self) -> Any:
        async with self._loading:
            if self._model is None:
                try:
                    self._model = await asyncio.to_thread(_load_model2vec, self.path)
                except (OSError, ValueError, KeyError, RuntimeError) as exc:
                    raise EmbeddingError(f"memory.model_path {self.path}: {exc}") from None
            return self._model

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        model = await self._loaded()
        clipped = [text[:LOCAL_MAX_CHARS] for text in texts]
        out = await asyncio.to_thread(model.encode, clipped)
        return unit_rows(np.asarray(out, dtype=np.float32).reshape(len(clipped), -1))

    async def close(self) -> None:
        return None


def _load_model2vec(path: Path) -> Any:
    # Never the hub: the directory is checked to exist, and the library is told it is
    # offline before its first import (huggingface_hub reads this once).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from model2vec import StaticModel

    return StaticModel.from_pretrained(path, force_download=False)


def local_model_problem(config: GatewayConfig) -> str | None:
    """Why `embedding: local` cannot run (None: it can, or another backend is chosen);
    the directory and the library are looked at, nothing is loaded."""
    memory = config.memory
    if memory.embedding != "local":
        return None
    path = Path(memory.model_path or "").expanduser()
    if importlib.util.find_spec(LOCAL_LIBRARY) is None:
        return (
            "memory.embedding: local needs the model2vec library:"
            " pip install 'hermes-gateway[local-embeddings]'"
        )
    if not path.is_dir():
        return f"memory.model_path: {path} is not a directory"
    missing = [name for name in LOCAL_FILES if not (path / name).is_file()]
    if missing or not any(path.glob("*.safetensors")):
        wanted = ", ".join([*missing, "*.safetensors"] if missing else ["*.safetensors"])
        return f"memory.model_path: {path} holds no model2vec model (missing {wanted})"
    return None


def unit_rows(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (a zero row stays zero): a dot product is then cosine."""
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return np.divide(matrix, norms, out=np.zeros_like(matrix), where=norms > 0)


def build_embedder(config: GatewayConfig) -> Embedder:
    """The configured backend. Raises ConfigError (exit 78) when `local` cannot run."""
    memory = config.memory
    if memory.embedding == "hash":
        return HashEmbedder(memory.hash_dimensions)
    if memory.embedding == "local":
        problem = local_model_problem(config)
        if problem is not None:
            raise ConfigError(problem)
        return LocalEmbedder(Path(memory.model_path or "").expanduser())
    return OpenAIEmbedder(
        base_url=memory.base_url or config.agent.base_url,
        model=memory.model,
        api_key=memory.api_key if memory.api_key is not None else config.agent.api_key,
        dimensions=memory.dimensions,
        timeout=memory.request_timeout_seconds,
    )
