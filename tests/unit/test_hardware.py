"""The dtype and thread decisions, asked about machines described by their facts."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import pytest

from tests.procfs import vm_flags
from worker.config import EngineConfig
from worker.hardware import (
    HUGE_PAGE,
    MALLOC_ENV,
    THP_SETTING,
    advise_huge_pages,
    available_cores,
    cgroup_cpu_limit,
    choose_dtype,
    choose_int16_linear,
    choose_key_layout,
    choose_kv_dtype,
    choose_output_head,
    choose_prefill_attention,
    fast_bf16,
    int8_reduce_range,
    keep_freed_memory,
    parse_cpu_flags,
    parse_cpu_vendor,
    read_cpu_vendor,
    resolve_device,
)

AMD_EPYC_FLAGS = frozenset(["fma", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"])
XEON_NO_BF16_FLAGS = frozenset(["fma", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512ifma"])
SAPPHIRE_RAPIDS_FLAGS = frozenset(["avx512f", "amx_tile", "amx_int8", "amx_bf16"])
EPYC_AVX2_FLAGS = frozenset(["fma", "avx2", "f16c"])


def test_auto_picks_bfloat16_only_where_the_cpu_multiplies_it_natively() -> None:
    amd = choose_dtype("auto", "cpu", AMD_EPYC_FLAGS)
    assert amd.dtype == "bfloat16" and "avx512_bf16" in amd.reason
    assert choose_dtype("auto", "cpu", SAPPHIRE_RAPIDS_FLAGS).dtype == "bfloat16"
    xeon = choose_dtype("auto", "cpu", XEON_NO_BF16_FLAGS)
    assert xeon.dtype == "float32" and "no native bfloat16" in xeon.reason
    assert choose_dtype("auto", "cpu", frozenset()).dtype == "float32"


AVX2_VNNI_FLAGS = frozenset(["fma", "avx2", "avx_vnni"])  # e.g. Alder Lake
AVX2_FLAGS = frozenset(["fma", "avx2"])


def test_auto_picks_int8_only_with_integer_dot_products_and_agreement_over_the_bar() -> None:
    # The measured agreement is under the bar: float32, and the log says why.
    xeon = choose_dtype("auto", "cpu", XEON_NO_BF16_FLAGS)
    assert xeon.dtype == "float32" and "under the 99% bar" in xeon.reason
    # Were it over the bar: int8 wherever the CPU has VNNI (or AMX int8), not elsewhere.
    for flags in (XEON_NO_BF16_FLAGS, AVX2_VNNI_FLAGS, frozenset(["avx512f", "amx_int8"])):
        got = choose_dtype("auto", "cpu", flags, int8_agreement=0.995)
        assert got.dtype == "int8" and "99.5%" in got.reason
    plain = choose_dtype("auto", "cpu", AVX2_FLAGS, int8_agreement=0.995)
    assert plain.dtype == "float32" and "integer dot products" in plain.reason
    # Native bfloat16 still comes first.
    assert choose_dtype("auto", "cpu", AMD_EPYC_FLAGS, int8_agreement=1.0).dtype == "bfloat16"
    assert choose_dtype("int8", "cpu", AVX2_FLAGS).dtype == "int8"


def test_int8_inputs_take_7_bits_only_without_vnni() -> None:
    assert not int8_reduce_range(XEON_NO_BF16_FLAGS)
    assert not int8_reduce_range(AVX2_VNNI_FLAGS)
    assert int8_reduce_range(AVX2_FLAGS)


def test_an_explicit_dtype_is_kept_whatever_the_cpu() -> None:
    assert choose_dtype("float32", "cpu", AMD_EPYC_FLAGS).dtype == "float32"
    assert choose_dtype("bfloat16", "cpu", XEON_NO_BF16_FLAGS).dtype == "bfloat16"


def test_auto_on_cuda_follows_the_device() -> None:
    assert choose_dtype("auto", "cuda", frozenset(), cuda_bf16=True).dtype == "bfloat16"
    assert choose_dtype("auto", "cuda:1", frozenset(), cuda_bf16=False).dtype == "float16"


def test_the_kv_cache_follows_the_activations_unless_asked() -> None:
    auto = choose_kv_dtype("auto", "cpu", "float32")
    assert auto.dtype == "float32" and "activations" in auto.reason
    # bfloat16 where the CPU multiplies it natively and the C kernel reads the cache...
    narrow = choose_kv_dtype("auto", "cpu", "float32", "bfloat16", in_place_decode=True)
    assert narrow.dtype == "bfloat16" and "in-place" in narrow.reason
    # ...not behind float32 linear layers, nor where decode gathers blocks instead
    assert choose_kv_dtype("auto", "cpu", "float32", "float32", True).dtype == "float32"
    int16 = choose_kv_dtype("auto", "cpu", "float32", "int16", in_place_decode=True)
    assert int16.dtype == "bfloat16" and "int16 linear layers" in int16.reason
    assert choose_kv_dtype("auto", "cpu", "float32", "int16", False).dtype == "float32"
    assert choose_kv_dtype("auto", "cpu", "float32", "bfloat16", False).dtype == "float32"
    assert choose_kv_dtype("float32", "cpu", "float32", "bfloat16", True).dtype == "float32"
    explicit = choose_kv_dtype("bfloat16", "cpu", "float32")
    assert explicit.dtype == "bfloat16" and explicit.reason == "set explicitly"
    assert choose_kv_dtype("auto", "cuda", "bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="model's dtype"):
        choose_kv_dtype("float32", "cuda", "bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        choose_kv_dtype("float16", "cpu", "float32")
    # int8 only when asked for, on CPU (at the agreement bar: auto never takes it)
    assert choose_kv_dtype("int8", "cpu", "float32").dtype == "int8"
    assert choose_kv_dtype("auto", "cpu", "float32", "bfloat16", True).dtype != "int8"
    with pytest.raises(ValueError, match="model's dtype"):
        choose_kv_dtype("int8", "cuda", "bfloat16")


def test_amx_takes_int8_values_behind_bfloat16_keys() -> None:
    """On a CPU with AMX behind bfloat16 layers, decode attention in place: bfloat16 keys
    over int8 values (values cost no agreement, keys would); not where prompts are asked
    to be attended from the cache (the C prompt kernel reads bfloat16 or float32 caches
    only; the decode kernel's prompt rows would read rounded values), nor without AMX,
    nor behind int16 layers (whose prompts take the C kernels)."""
    amx = frozenset({"avx512_bf16", "amx_bf16"})
    mixed = choose_kv_dtype("auto", "cpu", "float32", "bfloat16", True, amx)
    assert mixed.dtype == "bfloat16-int8" and "AMX" in mixed.reason
    cached = choose_kv_dtype("auto", "cpu", "float32", "bfloat16", True, amx, True)
    assert cached.dtype == "bfloat16"
    assert choose_kv_dtype("auto", "cpu", "float32", "bfloat16", False, amx).dtype == "float32"
    no_amx = frozenset({"avx512_bf16"})
    assert choose_kv_dtype("auto", "cpu", "float32", "bfloat16", True, no_amx).dtype == "bfloat16"
    assert choose_kv_dtype("auto", "cpu", "float32", "int16", True, amx).dtype == "bfloat16"
    explicit = choose_kv_dtype("bfloat16-int8", "cpu", "float32")
    assert explicit.dtype == "bfloat16-int8" and explicit.reason == "set explicitly"
    with pytest.raises(ValueError, match="model's dtype"):
        choose_kv_dtype("bfloat16-int8", "cuda", "bfloat16")


def test_prefill_attention_takes_bfloat16_only_with_amx_behind_bfloat16_layers() -> None:
    amx = frozenset({"avx512_bf16", "amx_bf16"})
    chosen = choose_prefill_attention("auto", "cpu", "bfloat16", amx)
    assert chosen.dtype == "bfloat16" and "AMX" in chosen.reason
    # avx512_bf16 alone (bf16 SDPA measured no faster there), or float32 layers: float32
    assert choose_prefill_attention("auto", "cpu", "bfloat16", amx - {"amx_bf16"}).dtype == (
        "float32"
    )
    assert choose_prefill_attention("auto", "cpu", "float32", amx).dtype == "float32"
    explicit = choose_prefill_attention("bfloat16", "cpu", "float32", frozenset())
    assert explicit.dtype == "bfloat16" and explicit.reason == "set explicitly"
    assert choose_prefill_attention("auto", "cuda", "float16", amx).dtype == "float16"
    with pytest.raises(ValueError, match="CPU setting"):
        choose_prefill_attention("bfloat16", "cuda", "bfloat16", amx)
    with pytest.raises(ValueError, match="prefill_attention must be one of"):
        choose_prefill_attention("int8", "cpu", "bfloat16", amx)


def test_prefill_attention_takes_the_kernel_with_avx512_bf16_without_amx() -> None:
    bf16 = frozenset({"avx512f", "avx512_bf16"})
    chosen = choose_prefill_attention("auto", "cpu", "bfloat16", bf16, in_place=True)
    assert chosen.dtype == "native" and "avx512_bf16 without AMX" in chosen.reason
    # without the kernel in this engine, with float32 layers or another cache, or with AMX:
    # as before
    assert choose_prefill_attention("auto", "cpu", "bfloat16", bf16).dtype == "float32"
    for cache in ("int8", "float32"):
        other = choose_prefill_attention("auto", "cpu", "bfloat16", bf16, True, kv_dtype=cache)
        assert other.dtype == "float32"
    assert choose_prefill_attention("auto", "cpu", "float32", bf16, in_place=True).dtype == (
        "float32"
    )
    amx = bf16 | {"amx_bf16"}
    assert choose_prefill_attention("auto", "cpu", "bfloat16", amx, in_place=True).dtype == (
        "bfloat16"
    )
    # where the prompt kernel takes keys in pairs: it, unless the keys are asked to be rows
    pairs = choose_prefill_attention(
        "auto", "cpu", "bfloat16", bf16, True, "bfloat16", True, prompt_pairs=True
    )
    assert pairs.dtype == "flash" and "over keys in pairs" in pairs.reason
    for other in (
        {"key_layout": "rows"},
        {"kv_dtype": "bfloat16-int8"},
        {"linear_dtype": "float32"},
        {"cpu_flags": amx},
    ):
        kw = {"linear_dtype": "bfloat16", "cpu_flags": bf16, "kv_dtype": "bfloat16"} | other
        chosen = choose_prefill_attention(
            "auto", "cpu", in_place=True, prompt_kernel=True, prompt_pairs=True, **kw
        )
        assert chosen.dtype != "flash", other
    # asked for explicitly, it needs the kernel
    explicit = choose_prefill_attention("native", "cpu", "float32", frozenset(), in_place=True)
    assert explicit.dtype == "native" and explicit.reason == "set explicitly"
    with pytest.raises(ValueError, match="C decode kernel"):
        choose_prefill_attention("native", "cpu", "bfloat16", bf16, in_place=False)
    # and the config refuses it where it can never apply, before any model loads
    for wrong in ({"device": "cuda"}, {"attention": "torch"}):
        with pytest.raises(ValueError, match="prefill_attention 'native'"):
            EngineConfig(prefill_attention="native", **wrong)
    assert EngineConfig(prefill_attention="native").prefill_attention == "native"


def test_flags_come_from_the_first_processor() -> None:
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx512_bf16 sse\n\n"
    text += "processor\t: 1\nflags\t\t: fpu\n"
    assert parse_cpu_flags(text) == frozenset({"fpu", "avx512_bf16", "sse"})
    assert parse_cpu_flags("no flags here") == frozenset()


@pytest.mark.parametrize(
    ("text", "cores"),
    [("max 100000", None), ("200000 100000", 2.0), ("150000 100000", 1.5), ("garbage", None)],
)
def test_cgroup_cpu_max(text: str, cores: float | None) -> None:
    assert cgroup_cpu_limit(text) == cores


def test_threads_follow_affinity_and_quota_not_the_host() -> None:
    assert available_cores(affinity=64, cgroup_limit=None) == 64
    assert available_cores(affinity=64, cgroup_limit=2.0) == 2
    assert available_cores(affinity=64, cgroup_limit=1.5) == 2  # a part core rounds up
    assert available_cores(affinity=2, cgroup_limit=8.0) == 2
    assert available_cores(affinity=0, cgroup_limit=0.5) == 1


def test_the_output_projection_narrows_beside_auto_float32_only() -> None:
    """Float32 layers chosen by auto take int8 candidates (re-scored in float32); an
    explicit float32 keeps one exact projection; narrower layers keep their own dtype."""
    auto = choose_output_head("auto", "float32", "cpu")
    assert auto.dtype == "int8" and "re-scored in float32" in auto.reason
    assert choose_output_head("float32", "float32", "cpu").dtype == "float32"
    assert choose_output_head("auto", "bfloat16", "cpu").dtype == "bfloat16"
    assert choose_output_head("int8", "int8", "cpu").dtype == "int8"
    assert choose_output_head("auto", "float16", "cuda").dtype == "float16"


def test_int16_linear_layers_where_auto_chose_float32_on_an_avx2_or_vnni_cpu() -> None:
    """Auto computes float32 layers as int16 products on a CPU whose widest vectors are
    AVX2 (the AVX2 build, 8 lanes) or with the AVX-512 VNNI build (16 lanes), where it
    chose float32 itself and the kernel is there; nowhere else (not the AVX2 build on an
    AVX-512 CPU). An explicit int16 is granted or refused with the reason."""
    auto = choose_int16_linear("auto", True, "float32", EPYC_AVX2_FLAGS, lanes=8)
    assert auto is not None and auto.dtype == "int16" and "AVX2" in auto.reason
    vnni = choose_int16_linear("auto", True, "float32", XEON_NO_BF16_FLAGS, lanes=16)
    assert vnni is not None and "AVX-512 VNNI" in vnni.reason
    skylake = frozenset(["fma", "avx2", "avx512f", "avx512bw"])  # AVX-512 without VNNI
    for linear, auto_dtype, flags, lanes in (
        ("auto", False, EPYC_AVX2_FLAGS, 8),  # float32 asked for: exact
        ("auto", False, XEON_NO_BF16_FLAGS, 16),
        ("auto", True, skylake, 8),  # AVX-512 FMAs as wide as the AVX2 build's products
        ("auto", True, XEON_NO_BF16_FLAGS, 8),  # a compiler without VNNI: the AVX2 build
        ("auto", True, EPYC_AVX2_FLAGS, 0),  # no kernel, C layer ops or fitting layers
        ("onednn", True, EPYC_AVX2_FLAGS, 8),  # another backend asked for
    ):
        assert choose_int16_linear(linear, auto_dtype, "float32", flags, lanes) is None
    assert choose_int16_linear("auto", True, "bfloat16", EPYC_AVX2_FLAGS, 8) is None
    explicit = choose_int16_linear("int16", False, "float32", AMD_EPYC_FLAGS, 16)
    assert explicit is not None and explicit.reason == "int16 set explicitly"
    with pytest.raises(ValueError, match="this model's are bfloat16"):
        choose_int16_linear("int16", True, "bfloat16", AMD_EPYC_FLAGS, 16)
    with pytest.raises(ValueError, match="AVX2 and FMA"):
        choose_int16_linear("int16", True, "float32", EPYC_AVX2_FLAGS, 0)
    with pytest.raises(ValueError, match="'int16' is for CPU"):
        EngineConfig(device="cuda", linear="int16")


def test_huge_pages_are_asked_for_whole_pages_only_where_the_kernel_allows(tmp_path) -> None:
    region = mmap.mmap(-1, 8 * HUGE_PAGE)  # anonymous, untouched
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    setting = tmp_path / "enabled"
    try:
        setting.write_text("always madvise [never]\n")
        assert not advise_huge_pages(address, 8 * HUGE_PAGE, setting)
        setting.write_text("always [madvise] never\n")
        assert not advise_huge_pages(address + 1, HUGE_PAGE, setting)  # no whole page inside
        assert "hg" not in vm_flags(address + 4 * HUGE_PAGE)
        # A kernel built without transparent huge pages (no THP_SETTING) refuses the call.
        took = THP_SETTING.exists()
        assert advise_huge_pages(address, 8 * HUGE_PAGE, setting) == took
        assert ("hg" in vm_flags(address + 4 * HUGE_PAGE)) == took
    finally:
        region.close()


def test_a_bare_cuda_device_gets_the_current_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors on "cuda" report "cuda:N"; the sampler's generator must be made on that,
    or every sampled step is refused as being on another device."""
    import torch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


def test_prefill_attention_takes_the_prompt_kernel_with_avx2_without_avx512() -> None:
    avx2 = frozenset({"avx2", "fma"})
    chosen = choose_prefill_attention("auto", "cpu", "float32", avx2, True, "bfloat16", True)
    assert chosen.dtype == "flash" and "AVX2 without AVX-512" in chosen.reason
    # without the kernel for this engine, or float32 layers on a CPU with AVX-512
    # (unmeasured): float32 SDPA
    assert choose_prefill_attention("auto", "cpu", "float32", avx2, True).dtype == "float32"
    avx512 = avx2 | {"avx512f", "avx512_vnni"}
    assert (
        choose_prefill_attention("auto", "cpu", "float32", avx512, True, "float32", True).dtype
        == "float32"
    )
    # the measured choices elsewhere stand with the kernel at hand
    bf16 = frozenset({"avx512f", "avx512_bf16"})
    assert (
        choose_prefill_attention("auto", "cpu", "bfloat16", bf16, True, "bfloat16", True).dtype
        == "native"
    )
    # behind int16 layers over a bfloat16 cache the kernel on any CPU that has it
    int16 = choose_prefill_attention("auto", "cpu", "int16", avx512, True, "bfloat16", True)
    assert int16.dtype == "flash" and "int16 linear layers" in int16.reason
    assert choose_prefill_attention("auto", "cpu", "int16", avx512, True, "bfloat16").dtype == (
        "float32"
    )
    assert (
        choose_prefill_attention("auto", "cpu", "int16", avx512, True, "float32", True).dtype
        == "float32"
    )
    explicit = choose_prefill_attention("flash", "cpu", "float32", avx512, True, "float32", True)
    assert explicit.dtype == "flash" and explicit.reason == "set explicitly"
    with pytest.raises(ValueError, match="C prompt kernel"):
        choose_prefill_attention("flash", "cpu", "float32", avx2, True, "int8", False)


XEON_BF16_NO_AMX_FLAGS = frozenset(
    ["fma", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16"]
)


def test_bfloat16_on_an_intel_core_only_with_amx() -> None:
    """An Intel core's vdpbf16ps does no more products a cycle than float32 FMAs: without
    AMX auto leaves bfloat16 aside there (and the int16 layers follow), on an AMD EPYC
    avx512_bf16 is enough, and AMX is enough whoever made it."""
    intel = choose_dtype("auto", "cpu", XEON_BF16_NO_AMX_FLAGS, cpu_vendor="GenuineIntel")
    assert intel.dtype == "float32" and "Intel core" in intel.reason
    assert "under the 99% bar" in intel.reason
    int16 = choose_int16_linear("auto", True, intel.dtype, XEON_BF16_NO_AMX_FLAGS, 16)
    assert int16 is not None and int16.dtype == "int16"
    amd = choose_dtype("auto", "cpu", XEON_BF16_NO_AMX_FLAGS, cpu_vendor="AuthenticAMD")
    assert amd.dtype == "bfloat16" and "avx512_bf16" in amd.reason
    amx = SAPPHIRE_RAPIDS_FLAGS | {"avx512_bf16"}
    with_amx = choose_dtype("auto", "cpu", amx, cpu_vendor="GenuineIntel")
    assert with_amx.dtype == "bfloat16" and "amx_bf16" in with_amx.reason
    assert fast_bf16(XEON_BF16_NO_AMX_FLAGS, "GenuineIntel") == []
    assert fast_bf16(XEON_BF16_NO_AMX_FLAGS, "") == ["avx512_bf16"]
    asked = choose_dtype("bfloat16", "cpu", XEON_BF16_NO_AMX_FLAGS, cpu_vendor="GenuineIntel")
    assert asked.dtype == "bfloat16"


def test_the_vendor_comes_from_the_first_processor(tmp_path) -> None:
    text = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu\n\n"
    text += "processor\t: 1\nvendor_id\t: AuthenticAMD\n"
    assert parse_cpu_vendor(text) == "GenuineIntel"
    assert parse_cpu_vendor("no vendor here") == ""
    assert read_cpu_vendor(tmp_path / "missing") == ""


# A fresh interpreter that frees 4 blocks of 16 MB after each of 8 rounds of writing them,
# as a prompt step's layers do with their temporaries, and prints the minor page faults
# of rounds 3-8 (the first two settle glibc's moving threshold). It turns transparent huge
# pages off for itself (prctl PR_SET_THP_DISABLE), so that a fault is one 4 KB page
# whatever the machine's THP setting (`always` would fault 2 MB at a time).
FAULT_ROUNDS = """
import ctypes, resource, sys
from worker.hardware import keep_freed_memory
assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 16 << 20
for r in range(8):
    if r == 2:
        start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(4)]
    for b in blocks:
        libc.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


def test_freed_step_memory_is_kept_for_the_next_step() -> None:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}

    def faults(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", FAULT_ROUNDS, mode],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        return int(run.stdout.split()[-1])

    pages = 6 * 4 * (16 << 20) // mmap.PAGESIZE  # written in rounds 3-8
    # glibc's defaults hand the blocks back and fault them in again every round
    assert faults("default") > pages // 2
    assert faults("keep") < pages // 50


def test_the_environment_s_malloc_settings_win() -> None:
    for name in MALLOC_ENV:
        assert keep_freed_memory({name: "1"}) == ""


def test_keys_in_pairs_where_the_c_kernel_reads_bfloat16_keys_by_avx512() -> None:
    amx = frozenset({"avx512f", "avx512_bf16", "amx_bf16"})
    shape = (3, 16)  # the default model's query heads a KV head, the default block size
    # AMX (Intel Xeon), avx512_bf16 without it (AMD EPYC Zen 4), AVX-512 alone
    for flags in (amx, amx - {"amx_bf16"}, frozenset({"avx512f"})):
        for kv in ("bfloat16", "bfloat16-int8"):
            auto = choose_key_layout("auto", "cpu", kv, True, "native", flags, *shape)
            assert auto.dtype == "pairs" and "AVX-512" in auto.reason
    # shapes the kernel's vector path does not take (its per-key loop: 2-3x the rows'
    # time), or a build without AVX-512: rows, saying why; asked for, pairs all the same
    for flags, group, bs in ((amx, 16, 16), (amx, 3, 8), (amx - {"avx512f"}, 3, 16)):
        auto = choose_key_layout("auto", "cpu", "bfloat16", True, "bfloat16", flags, group, bs)
        assert auto.dtype == "rows" and "16 keys a vector only" in auto.reason
        assert f"here {group} over blocks of {bs}" in auto.reason
        asked = choose_key_layout("pairs", "cpu", "bfloat16", True, "bfloat16", flags, group, bs)
        assert asked.dtype == "pairs"
    # AVX2 only (AMD EPYC Zen 3): rows, and why
    zen3 = frozenset({"avx2", "fma"})
    auto = choose_key_layout("auto", "cpu", "bfloat16", True, "native", zen3, *shape)
    assert auto.dtype == "rows" and "only with AVX-512" in auto.reason
    # what pairs cannot be: auto says why it takes rows, an explicit ask is refused
    for device, kv, in_place, prefill, why in (
        ("cuda", "bfloat16", False, "bfloat16", "on cuda"),
        ("cpu", "float32", True, "float32", "the KV cache is float32"),
        ("cpu", "int8", True, "bfloat16", "the KV cache is int8"),
        ("cpu", "bfloat16", False, "bfloat16", "lacks"),
        ("cpu", "bfloat16", True, "flash", "reads key rows here"),
    ):
        auto = choose_key_layout("auto", device, kv, in_place, prefill, amx, *shape)
        assert auto.dtype == "rows" and why in auto.reason
        with pytest.raises(ValueError, match=f"key_layout 'pairs' is not possible here: .*{why}"):
            choose_key_layout("pairs", device, kv, in_place, prefill, amx, *shape)
    assert (
        choose_key_layout("rows", "cpu", "bfloat16", True, "bfloat16", amx, *shape).dtype == "rows"
    )
    # the prompt kernel over keys in pairs, where it takes them: pairs
    zen4 = amx - {"amx_bf16"}
    over = choose_key_layout("auto", "cpu", "bfloat16", True, "flash", zen4, *shape, True)
    assert over.dtype == "pairs"
    assert choose_key_layout(
        "pairs", "cpu", "bfloat16", True, "native", frozenset(), *shape
    ).dtype == ("pairs")
    with pytest.raises(ValueError, match="key_layout must be one of"):
        choose_key_layout("columns", "cpu", "bfloat16", True, "bfloat16", amx, *shape)
    # the engine's setting, from the environment too, checked when the config is built
    assert EngineConfig.from_env({"KVFLOW_KEY_LAYOUT": "pairs"}).key_layout == "pairs"
    with pytest.raises(ValueError, match="key_layout must be one of"):
        EngineConfig(key_layout="columns")
