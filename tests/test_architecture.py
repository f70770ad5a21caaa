"""The floors hold: a torch-only core, one place that imports transformers, no module-level mutable state, bench and
examples on public names, and attention bindings that two threads cannot mix up."""
import ast
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("transformers", "vllm")


def _py(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out += [(n.lineno, a.name) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0:
            out.append((n.lineno, n.module or ""))
    return out


def test_the_core_imports_no_engine():
    bad = [f"{p.relative_to(ROOT)}:{line} {m}" for p in _py("kvpos") for line, m in _imported_modules(p)
           if m.split(".")[0] in ENGINES]
    assert not bad, f"kvpos/ must be torch-only: {bad}"


def test_transformers_is_imported_only_by_its_adapter_package():
    allowed = ROOT / "integrations" / "hf"
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in _py("integrations") for line, m in _imported_modules(p)
           if m.split(".")[0] == "transformers" and allowed not in p.parents]
    assert not bad, f"only integrations/hf/ may import transformers: {bad}"


def test_the_core_runs_where_transformers_cannot_be_imported():
    """Import every core module and run position operations in a fresh interpreter where `import transformers`
    fails (what `pip install kvpos` without the hf extra gives)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["transformers"] = None          # any import of transformers now raises ImportError
        import importlib, pkgutil, torch
        import kvpos
        for m in pkgutil.iter_modules(kvpos.__path__):
            if m.name != "integrations":
                importlib.import_module("kvpos." + m.name)
        from kvpos import PositionedKV, RopeSpec, rotate
        inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
        kv = PositionedKV([RopeSpec(inv, 1.0, 8, 8)] * 2)
        raw = [(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)) for _ in range(2)]
        kv.append_raw_(raw, torch.arange(5))
        kv.shift_(1, 4, 100).delete_(0, 1, close_gap=True)
        want = rotate(raw[1][0][:, :, 1:], kv.positions, kv.layers[1].spec)
        assert torch.allclose(kv.layers[1].keys, want, atol=1e-5), "wrong rotation"
        assert "transformers" not in [k for k, v in sys.modules.items() if v is not None]
        print("ok", kv.positions.tolist())
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KVPOS_NO_KERNEL": os.environ.get("KVPOS_NO_KERNEL", "")})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("ok [[100, 101, 102, 3]]"), res.stdout


def _module_level_state(path: Path, root: Path = ROOT) -> list[str]:
    """Module-level names bound to mutable containers (dict/list/set displays or calls), and `global` statements.

    The check used for the acceptance point: constants are tuples, frozensets, strings, numbers; the only
    module-level objects with per-context values are contextvars.ContextVar (per thread / task by design)."""
    tree = ast.parse(path.read_text())
    bad = []
    mutable_calls = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "WeakKeyDictionary",
                     "WeakValueDictionary"}
    for s in tree.body:
        targets, value = [], None
        if isinstance(s, ast.Assign):
            targets, value = s.targets, s.value
        elif isinstance(s, ast.AnnAssign) and s.value is not None:
            targets, value = [s.target], s.value
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if names and names != ["__all__"]:
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
                bad.append(f"{path.relative_to(root)}:{s.lineno} {names} is a mutable container")
            if isinstance(value, ast.Call):
                f = value.func
                fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if fname in mutable_calls:
                    bad.append(f"{path.relative_to(root)}:{s.lineno} {names} = {fname}(...)")
    for n in ast.walk(tree):
        if isinstance(n, (ast.Global, ast.Nonlocal)):
            bad.append(f"{path.relative_to(root)}:{n.lineno} `{type(n).__name__.lower()} {', '.join(n.names)}`")
    return bad


def test_no_module_level_mutable_state():
    bad = [b for folder in ("kvpos", "integrations") for p in _py(folder) for b in _module_level_state(p)]
    assert not bad, bad


def _private_package_imports(path: Path) -> list[str]:
    bad = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "kvpos":
            parts = (n.module or "").split(".")
            if any(p.startswith("_") for p in parts):
                bad.append(f"{path.name}:{n.lineno} from {n.module}")
            bad += [f"{path.name}:{n.lineno} {a.name}" for a in n.names if a.name.startswith("_")]
        if isinstance(n, ast.Import):
            bad += [f"{path.name}:{n.lineno} {a.name}" for a in n.names
                    if a.name.split(".")[0] == "kvpos" and any(p.startswith("_") for p in a.name.split("."))]
    return bad


def test_bench_and_examples_use_public_names_of_the_installed_package():
    bad = [b for folder in ("bench", "examples", "experiments") for p in _py(folder)
           for b in _private_package_imports(p)]
    assert not bad, f"private names of kvpos imported by bench/, examples/ or experiments/: {bad}"
    edits = [str(p.relative_to(ROOT)) for folder in ("bench", "examples", "experiments") for p in _py(folder)
             if "sys.path" in p.read_text()]
    assert not edits, f"bench/ and examples/ import the installed package, never a path: {edits}"


def test_the_import_checks_can_fail(tmp_path):
    f = tmp_path / "b.py"
    f.write_text("from kvpos._checks import fail\nfrom kvpos.cache import _grown\nimport kvpos._kernels\n")
    assert len(_private_package_imports(f)) == 3
    g = tmp_path / "c.py"
    g.write_text("_ACTIVE = {'cache': None}\nX: list = []\nY = dict()\nZ = (1, 2)\ndef f():\n    global W\n")
    assert len(_module_level_state(g, tmp_path)) == 4        # _ACTIVE, X, Y and the global; not the tuple


def test_importing_the_spec_room_does_not_load_the_transformers_adapter():
    """What the vLLM connector imports from hf/ (specs.py) loads neither the attention nor the cache code; the
    connector's own imports are checked by the vLLM suite."""
    code = ("import sys; from kvpos.integrations.hf.specs import rope_specs_from_config; "
            "print(sorted(m for m in sys.modules if m.startswith('kvpos.integrations.hf')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['kvpos.integrations.hf', 'kvpos.integrations.hf.specs']", out.stdout
    hf_imports = sorted({m for p in _py("integrations/vllm") for _, m in _imported_modules(p)
                         if m.startswith("kvpos.integrations.hf")})
    assert hf_imports == ["kvpos.integrations.hf.specs"], hf_imports


def _core_private_names() -> set[str]:
    """Private methods and attributes the core defines (def _x, self._x = ...): what adapters must not touch."""
    names = set()
    for p in _py("kvpos"):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.FunctionDef) and n.name.startswith("_") and not n.name.startswith("__"):
                names.add(n.name)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                    and n.value.id == "self" and n.attr.startswith("_") and not n.attr.startswith("__"):
                names.add(n.attr)
    return names


def _private_core_access(path: Path, private: set[str]) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{n.lineno} .{n.attr}"
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute) and n.attr in private]


def test_engine_adapters_use_only_public_names_of_the_core():
    """integrations/ drives the cache through its public protocol (write_rotated_, running_forward, sync_count,
    check_idle, ...), never through a private method or attribute of kvpos/ (self._x included: subclasses too)."""
    private = _core_private_names()
    bad = [b for p in _py("integrations") for b in _private_core_access(p, private)]
    assert not bad, f"private names of the core used by integrations/: {bad}"


def test_the_private_access_check_can_fail(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("def f(cache):\n    cache._rerotate(0, 1)\n    return cache.table._pos\n")
    assert len(_private_core_access(f, _core_private_names())) == 2


_MODE_NAMES = frozenset({"rotated", "raw", "int8"})


def _storage_string_tests(path: Path) -> list[str]:
    """Comparisons of a storage-mode string (x.storage == "raw", storage in STORAGES, ...): outside
    kvpos/cache/storages.py code asks a StorageMode's capabilities instead."""
    src = path.read_text()
    bad = []
    for n in ast.walk(ast.parse(src)):
        if not isinstance(n, ast.Compare):
            continue
        sides = [n.left, *n.comparators]
        text = " ".join(ast.get_source_segment(src, s) or "" for s in sides)
        consts = {s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)}
        if "storage" in text.lower() and (consts & _MODE_NAMES or "STORAGES" in text):
            bad.append(f"{path.name}:{n.lineno}")
    return bad


def test_no_storage_mode_string_test_outside_the_factory():
    bad = [b for folder in ("kvpos", "integrations") for p in _py(folder) if p.name != "storages.py"
           for b in _storage_string_tests(p)]
    assert not bad, f"storage-mode string comparisons (use cache.mode / StorageMode capabilities): {bad}"


def test_the_storage_string_check_can_fail(tmp_path):
    f = tmp_path / "s.py"
    f.write_text("def f(c, storage):\n    return c.storage == 'raw' or storage not in STORAGES or c.mode.quantized\n")
    assert _storage_string_tests(f) == ["s.py:2", "s.py:2"]        # both comparisons, not the capability


MAX_LINES = 500     # one room, one job: a library file past this has two jobs (C sources aside)


def test_no_library_file_is_over_the_room_size():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for folder in ("kvpos", "integrations") for p in _py(folder)
           if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"split these along their seams (at most {MAX_LINES} lines a file): {big}"


def _c_in_python(path: Path) -> list[str]:
    """String literals of a Python file that hold C (an #include or a function body with OpenMP pragmas)."""
    bad = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value) > 200 and (
                "#include" in n.value or "_Pragma(" in n.value):
            bad.append(f"{path.name}:{n.lineno}")
    return bad


def test_c_lives_in_c_files_shipped_as_package_data():
    bad = [b for folder in ("kvpos", "integrations") for p in _py(folder) for b in _c_in_python(p)]
    assert not bad, f"C source inside Python strings (move it to kvpos/csrc/): {bad}"
    from kvpos import _kernels
    for name in _kernels._SOURCES + _kernels._HEADERS:
        assert (ROOT / "kvpos" / "csrc" / name).is_file(), name
    assert '"csrc/*.c"' in (ROOT / "pyproject.toml").read_text(), "csrc/*.c must be package data"


def test_the_c_check_can_fail(tmp_path):
    f = tmp_path / "k.py"
    f.write_text('SRC = r"""\n#include <math.h>\n' + "x" * 300 + '\n"""\n')
    assert _c_in_python(f) == ["k.py:1"]


# ---------------------------------------------------------------------------------------------------------------------
# attention bindings: scoped per thread, explicit errors instead of fallbacks
# ---------------------------------------------------------------------------------------------------------------------

from kvpos.compose import SEG_CHUNK0  # noqa: E402
from kvpos.window import WindowConfig  # noqa: E402
from kvpos.integrations.ape import ApeBackend, use_ape  # noqa: E402
from kvpos.integrations.compose import ChunkComposer  # noqa: E402
from kvpos.integrations.hf import NAME, PositionedCache, current_binding, extend, generate  # noqa: E402
from kvpos.integrations.hf.testing import tiny_model  # noqa: E402
from kvpos.integrations.window import WindowBackend, use_window  # noqa: E402


def _jobs(model):
    g = torch.Generator().manual_seed(11)
    anchor = torch.randint(3, 128, (6,), generator=g)
    chunks = [torch.randint(3, 128, (12,), generator=g) for _ in range(4)]
    q = torch.randint(3, 128, (1, 5), generator=g)
    composer = ChunkComposer(model, anchor)
    composer.precompute(chunks, progress=False)
    long_ids = torch.randint(3, 128, (1, 90), generator=g)

    def plain():
        cache, _ = composer.compose(chunks, layout="sequential")
        return generate(model, cache, q, max_new_tokens=12, do_sample=False).tolist()

    def ape():
        cache, _ = composer.compose(chunks, layout="parallel")
        with use_ape(model, cache, temperature=0.5, scale=0.8):
            return generate(model, cache, q, max_new_tokens=12, do_sample=False).tolist()

    def window():
        cache = PositionedCache.from_model(model)
        extend(model, cache, long_ids)
        with use_window(model, cache, WindowConfig(sinks=2, window=8, budget=0.2)):
            return generate(model, cache, q, max_new_tokens=12, do_sample=False).tolist()

    return {"plain": plain, "ape": ape, "window": window}


def test_three_threads_with_their_own_cache_and_backend_equal_running_them_one_after_the_other():
    model = tiny_model("llama")[0]
    jobs = _jobs(model)
    alone = {k: f() for k, f in jobs.items()}
    assert len({str(v) for v in alone.values()}) == 3, "the three backends must give different tokens here"
    for _ in range(3):
        got, errors = {}, []
        barrier = threading.Barrier(len(jobs))

        def run(name):
            try:
                barrier.wait()
                got[name] = jobs[name]()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert got == alone
    assert current_binding() is None


def test_ape_backend_refuses_a_forward_that_is_not_on_the_bound_cache():
    model = tiny_model("llama")[0]
    g = torch.Generator().manual_seed(2)
    composer = ChunkComposer(model, torch.randint(3, 128, (5,), generator=g))
    chunks = [torch.randint(3, 128, (7,), generator=g) for _ in range(3)]
    bound, _ = composer.compose(chunks, layout="parallel")
    other, _ = composer.compose(chunks, layout="parallel")
    q = torch.randint(3, 128, (1, 3), generator=g)
    before = other.num_slots
    with use_ape(model, bound):
        with pytest.raises(ValueError, match="ApeBackend layer 0: expected the keys of the bound cache"):
            extend(model, other, q)                          # used to fall back to plain attention silently
        with pytest.raises(ValueError, match="expected the keys of the bound cache"):
            model(q, use_cache=False)                        # no cache at all
    assert other.num_slots == before                         # the failed forward left the cache as it was
    with pytest.raises(TypeError, match="ApeBackend cache: expected a PositionedCache"):
        with use_ape(model, None):
            pass


def test_ape_over_a_cache_without_context_slots_is_plain_attention_by_design():
    model = tiny_model("qwen2")[0]
    ids = torch.randint(3, 128, (1, 12))
    a, b = PositionedCache.from_model(model), PositionedCache.from_model(model)
    extend(model, a, ids[:, :8])
    extend(model, b, ids[:, :8])
    assert not bool((a.segments >= SEG_CHUNK0).any())
    plain = extend(model, a, ids[:, 8:])
    got = extend(model, b, ids[:, 8:], attention=ApeBackend())
    assert torch.equal(got, plain)


def test_window_backend_refuses_a_forward_that_is_not_on_the_bound_cache_and_hidden_slots_under_the_store():
    model = tiny_model("llama")[0]
    ids = torch.randint(3, 128, (1, 60))
    cache, other = PositionedCache.from_model(model), PositionedCache.from_model(model)
    extend(model, cache, ids)
    extend(model, other, ids)
    with use_window(model, cache, WindowConfig(sinks=2, window=8)):
        with pytest.raises(ValueError, match="WindowBackend layer 0: expected the keys of the bound cache"):
            extend(model, other, ids[:, :1])
    cache.hide_(20, 25)
    with pytest.raises(ValueError, match="WindowBackend .selector='store'.: expected a cache without hidden"):
        generate(model, cache, ids[:, :1], attention=WindowBackend(WindowConfig(sinks=2, window=8, selector="store",
                                                                                 far_scores="windowed")),
                 max_new_tokens=2, do_sample=False)
    assert cache.num_slots == 60                              # the failed call left the cache as it was


def test_window_far_store_decode_matches_the_dense_windowed_formulation():
    """selector='store' (int8 far store, fused scoring) decodes like the dense formulation with the same budget
    over every far slot (budget 1.0: the selection cannot differ; only int8 keys / fp16 values do)."""
    model = tiny_model("llama")[0]
    ids = torch.randint(3, 128, (1, 80))
    cache = PositionedCache.from_model(model)
    extend(model, cache, ids)
    dense = WindowBackend(WindowConfig(sinks=2, window=8, budget=1.0, selector="all", far_scores="windowed"))
    store = WindowBackend(WindowConfig(sinks=2, window=8, budget=1.0, selector="store", far_scores="windowed"))
    none = WindowBackend(WindowConfig(sinks=2, window=8, selector="none"))
    a = extend(model, cache.copy(), ids[:, :1], attention=dense)[0, -1]
    b = extend(model, cache.copy(), ids[:, :1], attention=store)[0, -1]
    c = extend(model, cache.copy(), ids[:, :1], attention=none)[0, -1]
    assert store.stats["far_slots"] == 80 - 2 - 8 + 1
    err = (a - b).abs().max()
    assert err < 0.03 * a.abs().max() and err < (a - c).abs().max() / 5 and int(a.argmax()) == int(b.argmax())
    out = generate(model, cache, ids[:, :1], attention=store, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 7) and store.stats["far_slots"] > 71     # the store grew as tokens left the window


def test_binding_refuses_models_off_sdpa_and_leaves_other_models_alone():
    model = tiny_model("llama")[0]
    other = tiny_model("llama", seed=1)[0]
    cache = PositionedCache.from_model(model)
    ids = torch.randint(3, 128, (1, 10))
    extend(model, cache, ids)
    ref = other(ids).logits
    with use_window(model, cache, WindowConfig(sinks=1, window=2)):
        assert torch.equal(other(ids).logits, ref)            # a model outside the binding is untouched
    eager = tiny_model("llama", seed=2)[0]
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="bind_attention model: expected a model using attn_implementation='sdpa'"):
        with use_ape(eager, PositionedCache.from_model(eager)):
            pass
    assert model.config._attn_implementation == NAME and current_binding() is None


def _context_variables(path: Path) -> list[str]:
    """`ContextVar(` constructions in a Python file, as file:line."""
    return [f"{path.name}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "ContextVar"]


def test_one_per_forward_scope_and_one_binding_scope_are_the_only_context_variables():
    found = sorted(c for folder in ("kvpos", "integrations") for p in _py(folder) for c in _context_variables(p))
    assert [c.split(":")[0] for c in found] == ["attention.py", "scope.py"], found


def test_the_context_variable_check_can_fail(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import contextvars\nA = contextvars.ContextVar('a')\nfrom contextvars import ContextVar\n"
                 "B = ContextVar('b')\n")
    assert _context_variables(f) == ["c.py:2", "c.py:4"]


class _Counting:
    """A backend that answers plain attention and counts its calls."""

    needs_cache = False

    def __init__(self):
        self.calls = 0

    def __call__(self, call, binding):
        self.calls += 1
        return call.plain()


def test_a_compiled_forward_inside_a_binding_reaches_the_backend():
    """Why bind_attention counts bindings on the model's modules (`_kvpos_bound`): compiled code cannot read the
    binding's context variable, and without a value it can guard on, a compiled forward would run SDPA while a
    backend is bound (silently ignoring it). The counter is module state dynamo guards on: binding recompiles."""
    from kvpos.integrations.hf import bind_attention

    model = tiny_model("llama")[0]
    ids = torch.randint(3, 128, (1, 7))
    cache = PositionedCache.from_model(model)                       # switches nothing: storage="rotated"
    model.set_attn_implementation(NAME)
    fwd = torch.compile(model.forward, backend="eager")
    with torch.no_grad():
        ref = fwd(input_ids=ids).logits                             # compiled, no binding: SDPA
        backend = _Counting()
        with bind_attention(model, backend):
            got = fwd(input_ids=ids).logits
        after = fwd(input_ids=ids).logits
    assert backend.calls == model.config.num_hidden_layers, backend.calls
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(after, ref)
    assert all(getattr(m, "_kvpos_bound", 0) == 0 for m in model.modules())
    del cache
