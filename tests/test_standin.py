"""The stand-in pair: committed CPU pair, provenance hashes, tokenizer, prompts, cache keying, metrics."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from sdsie import standin as S

CPU_DIR = S.COMMITTED_CPU_DIR


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """These models are tiny: one thread is as fast, and 2 threads on a shared 2-core machine can be 5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return S.read_manifest(CPU_DIR)


@pytest.fixture(scope="module")
def pair():
    return S.load_standin("cpu", device="cpu", dtype=torch.float32)


# ---- the committed CPU pair ---------------------------------------------------------------------


def test_committed_pair_loads_and_runs(pair) -> None:
    from transformers import LlamaForCausalLM

    target, scout, tok = pair
    assert isinstance(target, LlamaForCausalLM) and isinstance(scout, LlamaForCausalLM)
    assert not target.training and not scout.training
    ids = tok("def f(x: int) -> int:\n    return", return_tensors="pt").input_ids  # [1, P]
    for model in (target, scout):
        logits = model(input_ids=ids).logits  # [1, P, V]
        assert logits.shape == (1, ids.shape[1], len(tok))
        assert torch.isfinite(logits).all()


def test_scout_is_much_smaller_than_target(pair) -> None:
    target, scout, _ = pair
    assert scout.config.num_hidden_layers < target.config.num_hidden_layers
    assert S.n_params(scout) * 4 < S.n_params(target)


def test_target_and_scout_share_vocabulary(pair) -> None:
    target, scout, tok = pair
    for model in (target, scout):
        assert model.get_input_embeddings().weight.shape[0] == len(tok) == S.PRESETS["cpu"].vocab_size
        assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
            tok.bos_token_id,
            tok.eos_token_id,
            tok.pad_token_id,
        )


def test_committed_pair_fits_in_5_mb() -> None:
    total = sum(p.stat().st_size for p in CPU_DIR.rglob("*") if p.is_file())
    assert total <= 5 * 2**20, f"committed CPU pair is {total / 2**20:.2f} MiB"


def test_manifest_recipe_hash_matches_this_source(manifest) -> None:
    # Fails after any edit of sdsie/standin.py or of the cpu preset: rebuild the committed pair with
    # `python -m sdsie.standin build --preset cpu --out reproductions/standin/cpu`.
    assert manifest["config"] == json.loads(json.dumps(S.config_dict(S.PRESETS["cpu"])))
    assert manifest["recipe_hash"] == S.recipe_hash(S.PRESETS["cpu"])
    assert manifest["key"] == S.cache_key(S.PRESETS["cpu"], manifest["corpus_hash"])


def test_manifest_prompts_hash_matches_prompts_file(manifest) -> None:
    assert manifest["prompts_hash"] == S.prompts_hash()


def test_committed_corpus_listing_hashes_to_manifest(manifest) -> None:
    lines = (CPU_DIR / "corpus.tsv").read_text(encoding="utf-8").splitlines()
    assert len(lines) == manifest["corpus"]["train_files"] + manifest["corpus"]["val_files"]
    assert S.hash_manifest_lines(lines) == manifest["corpus_hash"]


def test_committed_corpus_matches_this_machines_stdlib(manifest) -> None:
    if manifest["corpus"]["python_version"] != platform.python_version():
        pytest.skip(
            f"the CPU pair was built from Python {manifest['corpus']['python_version']}'s stdlib; this is "
            f"{platform.python_version()}, whose stdlib differs (determinism is tested on a synthetic tree)"
        )
    corpus = S.load_corpus(S.PRESETS["cpu"].corpus)
    assert S.corpus_hash(corpus.files) == manifest["corpus_hash"]


def test_recorded_agreement_recomputes(pair, manifest) -> None:
    target, scout, tok = pair
    n_new = manifest["greedy_agreement"]["n_new_tokens"]
    got = S.greedy_agreement(target, scout, tok, S.load_prompts(), n_new)
    # A float argmax near-tie may flip on another BLAS build: at most one position per prompt.
    for pid, rate in manifest["greedy_agreement"]["by_prompt"].items():
        assert abs(got["by_prompt"][pid] - rate) <= 1 / n_new + 1e-9, pid


def test_code_family_is_the_low_entropy_family(pair) -> None:
    """The stand-in is trained on Python source: its mean next-token entropy is lowest on code."""
    from sdsie.entropy import entropy

    target, _, tok = pair
    by_family: dict[str, list[float]] = {}
    for p in S.load_prompts():
        seq = S.greedy_continuation(target, tok(p.text, return_tensors="pt").input_ids, 16)  # [1, P+16]
        with torch.no_grad():
            logits = target(input_ids=seq).logits[0, -17:-1]  # [16, V]: the continuation's steps
        by_family.setdefault(p.family, []).append(entropy(logits, unit="nats").mean().item())
    mean = {f: sum(v) / len(v) for f, v in by_family.items()}
    assert mean["code"] < mean["verse"] and mean["code"] < mean["prose"], mean


# ---- tokenizer ----------------------------------------------------------------------------------


@given(st.text(max_size=200))
def test_tokenizer_round_trips_any_text(pair, text: str) -> None:
    tok = pair[2]
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_round_trips_prompts(pair) -> None:
    tok = pair[2]
    for p in S.load_prompts():
        assert tok.decode(tok(p.text).input_ids, skip_special_tokens=True) == p.text


# ---- corpus hashing (machine independent) ---------------------------------------------------------


def _fake_stdlib(root, files: dict[str, bytes]):
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def _files(n: int = 40) -> dict[str, bytes]:
    return {f"pkg{i % 3}/mod{i}.py": f"def f{i}(x):\n    return x + {i}\n".encode() for i in range(n)}


def test_corpus_hash_is_deterministic_and_content_sensitive(tmp_path) -> None:
    cfg = S.CorpusConfig(val_fraction=0.2)
    root = _fake_stdlib(tmp_path / "a", _files())
    first = S.corpus_hash(S.load_corpus(cfg, {"stdlib": root}).files)
    assert S.corpus_hash(S.load_corpus(cfg, {"stdlib": root}).files) == first
    (root / "pkg1" / "mod1.py").write_bytes(b"def f1(x):\n    return x - 1\n")  # same size, new content
    assert S.corpus_hash(S.load_corpus(cfg, {"stdlib": root}).files) != first


def test_corpus_ignores_machine_specific_and_cached_files(tmp_path) -> None:
    cfg = S.CorpusConfig(val_fraction=0.2)
    root = _fake_stdlib(tmp_path / "a", _files())
    before = S.corpus_hash(S.load_corpus(cfg, {"stdlib": root}).files)
    extras = {
        "site-packages/x.py": b"a = 1\n",
        "__pycache__/y.py": b"b = 2\n",
        "_sysconfigdata__linux.py": b"c = 3\n",
        "config-3.11-x86_64-linux-gnu/z.py": b"d = 4\n",
        "notes.txt": b"not python\n",
    }
    _fake_stdlib(root, extras)
    corpus = S.load_corpus(cfg, {"stdlib": root})
    assert S.corpus_hash(corpus.files) == before
    _fake_stdlib(root, {"latin1.py": "s = 'caf\u00e9'\n".encode("latin-1")})
    corpus = S.load_corpus(cfg, {"stdlib": root})
    assert corpus.skipped_non_utf8 == ("stdlib/latin1.py",)
    assert S.corpus_hash(corpus.files) == before


def test_corpus_split_and_byte_cap(tmp_path) -> None:
    root = _fake_stdlib(tmp_path / "a", _files(200))
    full = S.load_corpus(S.CorpusConfig(val_fraction=0.2), {"stdlib": root})
    train, val = {f.relpath for f in full.train}, {f.relpath for f in full.val}
    assert not train & val and len(train | val) == 200
    assert all(name.startswith("stdlib/pkg") for name in train | val)
    assert 0.05 < len(val) / 200 < 0.4
    capped = S.load_corpus(S.CorpusConfig(val_fraction=0.2, max_bytes=2000), {"stdlib": root})
    assert sum(f.size for f in capped.files) <= 2000
    assert {f.relpath for f in capped.files} < train | val


def test_corpus_without_validation_files_is_refused(tmp_path) -> None:
    root = _fake_stdlib(tmp_path / "a", {"only.py": b"x = 1\n"})
    with pytest.raises(ValueError, match="validation"):
        S.load_corpus(S.CorpusConfig(val_fraction=0.01), {"stdlib": root})


# ---- prompts --------------------------------------------------------------------------------------


def test_prompts_cover_three_families_and_hash_is_stable() -> None:
    prompts = S.load_prompts()
    assert {p.family for p in prompts} == set(S.FAMILIES)
    assert S.prompts_hash(prompts) == S.prompts_hash()
    changed = (dataclasses.replace(prompts[0], text=prompts[0].text + " "), *prompts[1:])
    assert S.prompts_hash(changed) != S.prompts_hash(prompts)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ('[[prompt]]\nid="a"\nfamily="code"\nseed_label="Code"\ntext="x"\n', "no prompt for families"),
        ('[[prompt]]\nid="a"\nfamily="song"\nseed_label="S"\ntext="x"\n', "family 'song'"),
        ('[[prompt]]\nid="a"\nfamily="code"\ntext="x"\n', "lacks"),
        ("version = 1\n", "expected"),
    ],
)
def test_bad_prompts_file_is_refused(tmp_path, body: str, match: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(body, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        S.load_prompts(path)


def test_duplicate_prompt_ids_are_refused(tmp_path) -> None:
    body = "".join(f'[[prompt]]\nid="same"\nfamily="{f}"\nseed_label="L"\ntext="x"\n' for f in S.FAMILIES)
    path = tmp_path / "p.toml"
    path.write_text(body, encoding="utf-8")
    with pytest.raises(ValueError, match="duplicate"):
        S.load_prompts(path)


# ---- metrics ----------------------------------------------------------------------------------------


def test_kv_cached_greedy_continuation_equals_recomputation(pair) -> None:
    target, _, tok = pair
    ids = tok("class Stack:\n    def push(self, item):", return_tensors="pt").input_ids
    fast = S.greedy_continuation(target, ids, 12)
    slow = ids
    with torch.no_grad():
        for _ in range(12):
            nxt = target(input_ids=slow).logits[:, -1].argmax(-1, keepdim=True)
            slow = torch.cat([slow, nxt], dim=1)
    assert torch.equal(fast, slow)


class _OracleScout(torch.nn.Module):
    """A fake scout that knows the target's continuation and matches it at every `every`-th position."""

    def __init__(self, full: torch.Tensor, prompt_len: int, vocab: int, every: int) -> None:
        super().__init__()
        self.full, self.p, self.vocab, self.every = full, prompt_len, vocab, every
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # so next(parameters()) works

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> SimpleNamespace:
        n = input_ids.shape[1]  # [1, n]: the scout sees the sequence minus its last token
        nxt = self.full[0, 1 : n + 1].clone()  # [n]: the true next tokens
        pos = torch.arange(n) - (self.p - 1)
        wrong = (pos >= 0) & (pos % self.every != 0)
        nxt[wrong] = (nxt[wrong] + 1) % self.vocab
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, self.vocab).float()[None])  # [1, n, V]


def test_agreement_counts_matching_positions_exactly(pair) -> None:
    target, _, tok = pair
    ids = tok("import os\n", return_tensors="pt").input_ids  # [1, P]
    assert S.greedy_agreement_one(target, target, ids, 16) == 1.0
    full = S.greedy_continuation(target, ids, 16)  # [1, P + 16]
    for every, expected in ((1, 1.0), (2, 0.5), (4, 0.25), (17, 1 / 16)):
        oracle = _OracleScout(full, ids.shape[1], len(tok), every)
        assert S.greedy_agreement_one(target, oracle, ids, 16) == expected


def test_validation_loss_is_the_mean_ce_over_whole_windows(pair) -> None:
    target, _, _ = pair
    stream = torch.randint(0, 2048, (100,), generator=torch.Generator().manual_seed(0))  # 3 windows of 32
    with torch.no_grad():
        windows = stream[:97].unfold(0, 33, 32)  # [3, 33]
        logits = target(input_ids=windows[:, :-1]).logits  # [3, 32, V]
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].reshape(-1)).item()
    assert S.validation_loss(target, stream, context=32, max_tokens=1000, batch_size=2) == pytest.approx(
        expected, rel=1e-5
    )
    with pytest.raises(ValueError, match="shorter than one window"):
        S.validation_loss(target, stream[:20], context=32, max_tokens=300)


# ---- config validation and cache keying -------------------------------------------------------------


def test_unknown_preset_and_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown stand-in preset"):
        S.get_preset("tpu")
    with pytest.raises(ValueError, match="divisible"):
        S.ModelShape(n_layers=1, hidden=30, n_heads=4, intermediate=8)
    cpu = S.PRESETS["cpu"]
    with pytest.raises(ValueError, match="scout must not be larger"):
        dataclasses.replace(cpu, scout=cpu.target, target=cpu.scout)
    with pytest.raises(ValueError, match="warmup_steps"):
        dataclasses.replace(cpu.train, warmup_steps=cpu.train.steps)


def test_recipe_hash_tracks_the_config() -> None:
    cpu = S.PRESETS["cpu"]
    assert S.recipe_hash(cpu) == S.recipe_hash(dataclasses.replace(cpu))
    assert S.recipe_hash(cpu) != S.recipe_hash(dataclasses.replace(cpu, seed=cpu.seed + 1))
    assert S.recipe_hash(cpu) != S.recipe_hash(S.PRESETS["gpu"])


TINY = S.StandinConfig(
    name="tiny",
    vocab_size=300,
    context=16,
    target=S.ModelShape(n_layers=2, hidden=16, n_heads=2, intermediate=32),
    scout=S.ModelShape(n_layers=1, hidden=8, n_heads=2, intermediate=16),
    corpus=S.CorpusConfig(max_bytes=60_000, val_fraction=0.2, include_tests=False),
    train=S.TrainConfig(steps=3, batch_size=2, lr_target=1e-3, lr_scout=1e-3, warmup_steps=1),
    eval_tokens=32,
    agreement_tokens=2,
)


def test_cache_builds_once_then_hits(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SDSIE_CACHE", str(tmp_path))
    built = S.ensure_standin(TINY, torch.device("cpu"))
    assert built.parent == tmp_path / "standin" and built.name.startswith("tiny-")
    manifest = S.read_manifest(built)
    assert manifest["key"] == built.name and manifest["train"]["phases"]["joint"]["steps_completed"] == 3
    target, scout, tok = S.load_standin_pair(built)
    assert target.config.num_hidden_layers == 2 and len(tok) == 300

    def no_training(*args, **kwargs):
        raise AssertionError("cache hit expected: nothing may be trained")

    monkeypatch.setattr(S, "train_pair", no_training)
    assert S.ensure_standin(TINY, torch.device("cpu")) == built  # hit
    with pytest.raises(AssertionError, match="cache hit expected"):  # another recipe: a miss
        S.ensure_standin(dataclasses.replace(TINY, seed=1), torch.device("cpu"))


def test_tiny_build_is_bitwise_repeatable_on_cpu(tmp_path) -> None:
    a = S.build_standin(TINY, tmp_path / "a", torch.device("cpu"))
    b = S.build_standin(TINY, tmp_path / "b", torch.device("cpu"))
    assert a["validation_loss_nats"] == b["validation_loss_nats"]
    for part in ("target/model.safetensors", "scout/model.safetensors", "tokenizer/tokenizer.json"):
        assert (tmp_path / "a" / part).read_bytes() == (tmp_path / "b" / part).read_bytes(), part


def test_roots_fill_in_order_under_a_byte_cap(tmp_path) -> None:
    std = _fake_stdlib(tmp_path / "std", _files(30))
    site = _fake_stdlib(tmp_path / "site", {f"lib{i}/m.py": b"y = 2\n" * 20 for i in range(30)})
    std_bytes = sum(len(v) for v in _files(30).values())
    corpus = S.load_corpus(S.CorpusConfig(val_fraction=0.2, max_bytes=std_bytes + 500), {"stdlib": std, "site": site})
    names = [f.relpath for f in corpus.files]
    assert sum(n.startswith("stdlib/") for n in names) == 30  # the whole first root
    assert 0 < sum(n.startswith("site/") for n in names) < 30  # the rest of the cap from the second
    assert sum(f.size for f in corpus.files) <= std_bytes + 500


def test_scout_from_target_copies_embeddings_and_early_layers(pair) -> None:
    target, _, tok = pair
    cpu = S.PRESETS["cpu"]
    cfg = dataclasses.replace(
        cpu,
        scout=dataclasses.replace(cpu.target, n_layers=1),
        scout_phase=S.ScoutPhaseConfig(steps=2, lr=1e-3, warmup_steps=0, init_from_target=True),
    )
    scout = S.scout_from_target(target, cfg, tok)
    t_state, s_state = target.state_dict(), scout.state_dict()
    for name, value in s_state.items():
        assert torch.equal(value, t_state[name]), name
    assert scout.config.num_hidden_layers == 1
    assert scout.get_output_embeddings().weight.data_ptr() == scout.get_input_embeddings().weight.data_ptr()


def test_scout_initialized_from_target_needs_its_width() -> None:
    cpu = S.PRESETS["cpu"]
    with pytest.raises(ValueError, match="target's width"):
        dataclasses.replace(
            cpu, scout_phase=S.ScoutPhaseConfig(steps=2, lr=1e-3, warmup_steps=0, init_from_target=True)
        )


def test_two_phase_recipe_trains_target_then_distills_an_early_exit_scout(tmp_path) -> None:
    cfg = dataclasses.replace(
        TINY,
        scout=dataclasses.replace(TINY.target, n_layers=1),
        scout_phase=S.ScoutPhaseConfig(steps=2, lr=1e-3, warmup_steps=0, init_from_target=True),
    )
    manifest = S.build_standin(cfg, tmp_path / "pair", torch.device("cpu"))
    phases = manifest["train"]["phases"]
    assert list(phases) == ["target", "scout"]
    assert phases["target"]["steps_completed"] == TINY.train.steps and phases["scout"]["steps_completed"] == 2
    assert "scout_ce" not in phases["target"]["loss_history"][0]  # the target phase trains the target alone
    target, scout, _ = S.load_standin_pair(tmp_path / "pair")
    assert scout.config.num_hidden_layers == 1 and target.config.num_hidden_layers == 2


def _early_exit_config(steps: int):
    cpu = S.PRESETS["cpu"]
    return dataclasses.replace(
        cpu, train=dataclasses.replace(cpu.train, batch_size=2),
        scout=dataclasses.replace(cpu.target, n_layers=1),
        scout_phase=S.ScoutPhaseConfig(steps=steps, lr=1e-3, warmup_steps=0, init_from_target=True),
    )


def test_distill_scout_trains_on_the_windows_it_is_given_and_names_a_shortfall(pair) -> None:
    """`windows` replaces the recipe's random corpus windows (a probe distills on text the target wrote): given
    windows change what the scout learns; fewer windows than steps is an error, not a shorter phase."""
    target, _, tok = pair
    cfg = _early_exit_config(steps=3)
    stream = torch.randint(0, cfg.vocab_size, (4096,), generator=torch.Generator().manual_seed(0))
    mine = [torch.randint(0, cfg.vocab_size, (2, cfg.context + 1), generator=torch.Generator().manual_seed(i))
            for i in range(3)]
    scouts = {}
    for name, windows in (("recipe", None), ("given", mine)):
        scouts[name] = S.scout_from_target(target, cfg, tok)
        res = S.distill_scout(target, scouts[name], stream, cfg, torch.device("cpu"), windows=windows)
        assert res.steps_completed == 3 and not res.time_guard_hit
    recipe, given = (dict(scouts[n].named_parameters()) for n in ("recipe", "given"))
    assert any(not torch.equal(recipe[k], given[k]) for k in recipe)
    with pytest.raises(ValueError, match="got 2 batches for 3 steps"):
        S.distill_scout(target, S.scout_from_target(target, cfg, tok), stream, cfg, torch.device("cpu"),
                        windows=mine[:2])


# Deterministic training: the switch the gpu recipe trains under (research/standin/determinism_check.py measures
# whether builds repeat with it).


def test_deterministic_mode_is_strict_inside_and_restored_after(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with S._deterministic(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn_only keeps atomic attention
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() == before
    with S._deterministic(False):
        assert torch.are_deterministic_algorithms_enabled() == before


def test_the_recipe_setting_decides_the_mode_training_runs_in(monkeypatch) -> None:
    """train_reproducibly (what builds call) trains under deterministic kernels exactly when the recipe says so."""
    seen = []
    monkeypatch.setattr(S, "train_models", lambda *a: seen.append(torch.are_deterministic_algorithms_enabled()))
    before = torch.are_deterministic_algorithms_enabled()
    for det in (True, False):
        cpu = S.PRESETS["cpu"]
        cfg = dataclasses.replace(cpu, train=dataclasses.replace(cpu.train, deterministic=det))
        S.train_reproducibly(cfg, None, torch.device("cpu"))
    assert seen == [True, before] and torch.are_deterministic_algorithms_enabled() == before


def test_gather_nll_equals_nll_loss_with_its_gradient() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 7, generator=gen, requires_grad=True)
    y = torch.randint(0, 7, (12,), generator=gen)
    ref = F.nll_loss(F.log_softmax(logits, -1), y)
    (g_ref,) = torch.autograd.grad(ref, logits)
    with S._deterministic(True):
        got = S._nll(F.log_softmax(logits, -1), y)
        (g_got,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(g_got, g_ref)
