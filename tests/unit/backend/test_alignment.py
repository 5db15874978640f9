"""Tests of backend/alignment.py against ground truth and against the plain full DP.

Run B is made from run A by edits whose effect is known (`origin[j]` is the A position that B
event j was copied from, or -1 for an inserted event), so every test can say which pairs must
come back. Keys repeat the way real ones do: a layer's events carry the same key in every layer
of a step, a few events per step have a key of their own.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitguard.backend.alignment import Alignment, _stable_order, align, full_dp_align
from bitguard.errors import BadInput

FRESH = 1 << 40  # keys from here on never occur in a base run: events that exist only in B
SETTINGS = settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Runs and edits


@st.composite
def base_runs(draw, max_steps: int = 4, max_layers: int = 4) -> list[int]:
    """Run A: steps of [unique events] + layers x [layer events] + [unique events]."""
    steps = draw(st.integers(1, max_steps))
    layers = draw(st.integers(1, max_layers))
    layer = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))  # equal ints: equal keys
    head = draw(st.integers(0, 2))
    tail = draw(st.integers(0, 2))
    keys = []
    for step in range(steps):
        keys += [step * 1000 + 100 + u for u in range(head)]
        keys += [step * 1000 + slot for _ in range(layers) for slot in layer]
        keys += [step * 1000 + 200 + u for u in range(tail)]
    return keys


EDITS = st.lists(
    st.tuples(st.sampled_from(["delete", "insert", "swap"]), st.integers(0, 10**6), st.integers(0, 10**6)),
    max_size=12,
)
DELETES_AND_FRESH_INSERTS = st.lists(
    st.tuples(st.sampled_from(["delete", "insert"]), st.integers(0, 10**6), st.just(0)), max_size=12
)


def edit(base: list[int], ops) -> tuple[list[int], list[int]]:
    """(keys_b, origin) after applying ops to base.

    An insert takes a fresh key when its argument is even, else a key that occurs at least twice
    in base (an extra call of a repeated module), so no inserted event can fake an anchor. A
    swap exchanges an event with one 1 to 3 places later (branches finishing in another order).
    """
    repeated = sorted(k for k, c in Counter(base).items() if c > 1)
    events = [(key, pos) for pos, key in enumerate(base)]
    fresh = FRESH
    for kind, x, y in ops:
        if kind == "delete" and events:
            del events[x % len(events)]
        elif kind == "insert":
            if y % 2 == 0 or not repeated:
                key, fresh = fresh, fresh + 1
            else:
                key = repeated[y % len(repeated)]
            events.insert(x % (len(events) + 1), (key, -1))
        elif kind == "swap" and len(events) > 1:
            i = x % len(events)
            j = min(len(events) - 1, i + 1 + y % 3)
            events[i], events[j] = events[j], events[i]
    return [k for k, _ in events], [o for _, o in events]


def keys(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


# ---------------------------------------------------------------------------------------------
# Checks every alignment must pass


def check_valid(result: Alignment, ka: np.ndarray, kb: np.ndarray) -> None:
    """Pairs match equal keys, a_idx ascends, the monotone pairs ascend in B too, and every
    position is in exactly one pair or in the gap list of its run."""
    a, b = result.a_idx, result.b_idx
    assert a.dtype == np.int64 and b.dtype == np.int64
    assert result.gaps_a.dtype == np.int64 and result.gaps_b.dtype == np.int64
    assert result.reordered.dtype == np.bool_ and result.reordered.shape == a.shape
    assert np.array_equal(ka[a], kb[b]), f"unequal keys matched: A {ka[a]} vs B {kb[b]}"
    assert np.all(np.diff(a) > 0), f"a_idx not strictly ascending: {a}"
    mono_b = b[~result.reordered]
    assert np.all(np.diff(mono_b) > 0), f"monotone pairs cross in B: {mono_b}"
    all_a = np.sort(np.concatenate([a, result.gaps_a]))
    all_b = np.sort(np.concatenate([b, result.gaps_b]))
    assert np.array_equal(all_a, np.arange(ka.size)), f"A positions not partitioned: {all_a}"
    assert np.array_equal(all_b, np.arange(kb.size)), f"B positions not partitioned: {all_b}"


def lcs_length(ka: np.ndarray, kb: np.ndarray) -> int:
    result = full_dp_align(ka, kb)
    check_valid(result, ka, kb)
    return result.matched


def pairs_of(result: Alignment) -> set[tuple[int, int]]:
    return set(zip(result.a_idx.tolist(), result.b_idx.tolist()))


# ---------------------------------------------------------------------------------------------
# Properties


@SETTINGS
@given(base=base_runs())
def test_identical_runs_match_everything(base):
    ka = keys(base)
    result = align(ka, ka.copy())
    check_valid(result, ka, ka)
    assert np.array_equal(result.a_idx, np.arange(ka.size))
    assert np.array_equal(result.b_idx, np.arange(ka.size))
    assert not result.reordered.any() and result.gaps_a.size == 0 and result.gaps_b.size == 0


@SETTINGS
@given(base=base_runs(), ops=EDITS)
def test_every_true_pair_is_matched(base, ops):
    """Deletes, inserts and nearby swaps: every true pair comes back, monotone or reordered.

    Equal keys make the exact partner ambiguous (which of three equal events was deleted?), so
    per key the pairs must be at least the true pairs; a key unique in both runs has one
    possible partner, and that one must be it. The runs stay shorter than reorder_window.
    """
    kb_list, origin = edit(base, ops)
    ka, kb = keys(base), keys(kb_list)
    assert ka.size + kb.size < 256
    result = align(ka, kb)
    check_valid(result, ka, kb)
    true_pairs = [(a, b) for b, a in enumerate(origin) if a >= 0]
    found = Counter(ka[result.a_idx].tolist())
    wanted = Counter(base[a] for a, _ in true_pairs)
    short = {k: (found[k], n) for k, n in wanted.items() if found[k] < n}
    assert not short, f"keys with fewer pairs than true pairs (found, true): {short}"
    count_a, count_b = Counter(base), Counter(kb_list)
    unique = [(a, b) for a, b in true_pairs if count_a[base[a]] == 1 and count_b[base[a]] == 1]
    missing = set(unique) - pairs_of(result)
    assert not missing, f"true pairs of unique keys not matched: {sorted(missing)}"


@SETTINGS
@given(base=base_runs(), ops=DELETES_AND_FRESH_INSERTS)
def test_monotone_matches_equal_lcs_when_edits_fit_the_band(base, ops):
    """B = A with deletes and events of new keys: the LCS is exactly the true pairs, and the
    anchors plus the banded DP find all of it without the reorder pass."""
    kb_list, origin = edit(base, ops)
    ka, kb = keys(base), keys(kb_list)
    result = align(ka, kb, band=len(ops))  # the path never strays further than the edit count
    check_valid(result, ka, kb)
    true_pairs = sum(o >= 0 for o in origin)
    lcs = lcs_length(ka, kb)
    assert lcs == true_pairs, f"LCS {lcs} != true pairs {true_pairs}"
    assert not result.reordered.any(), f"reordered pairs {result.a_idx[result.reordered]}"
    assert result.matched == lcs, f"monotone matches {result.matched} != LCS {lcs}"
    assert result.gaps_a.size == ka.size - lcs and result.gaps_b.size == kb.size - lcs


@SETTINGS
@given(
    a=st.lists(st.integers(0, 3), max_size=40),
    b=st.lists(st.integers(0, 3), max_size=40),
    solver=st.sampled_from(["band", "sparse", "slope"]),
)
def test_without_anchors_and_with_a_full_band_align_is_the_lcs(a, b, solver):
    """Keys from a tiny alphabet, each doubled so no key is unique: no anchors, and with a band
    that covers every cell the band DP, the sparse LCS and the slope band must each find the
    full DP's LCS length."""
    ka, kb = keys(a + a), keys(b + b)
    limits = {"band": (10**9, 0), "sparse": (1, 10**9), "slope": (1, 0)}[solver]
    result = align(ka, kb, band=ka.size + kb.size, reorder_window=0, max_cells=limits[0], max_pairs=limits[1])
    check_valid(result, ka, kb)
    assert result.anchors == 0
    assert result.matched == lcs_length(ka, kb), f"align ({solver}) {result.matched} vs full DP"
    if result.windows:
        shared = bool(set(a) & set(b))  # with no equal pair the sparse LCS costs nothing
        expected = {"band": (0, 0), "sparse": (1, 0), "slope": (0, 1) if shared else (1, 0)}[solver]
        assert (result.sparse_windows, result.narrowed_windows) == expected


@SETTINGS
@given(
    a=st.lists(st.integers(0, 12), max_size=60),
    b=st.lists(st.integers(0, 12), max_size=60),
    band=st.integers(0, 6),
    reorder_window=st.sampled_from([0, 1, 5, 256]),
    max_cells=st.sampled_from([1, 30, 10**9]),
    max_pairs=st.sampled_from([0, 20, 10**9]),
)
def test_any_input_gives_a_valid_alignment(a, b, band, reorder_window, max_cells, max_pairs):
    """Unrelated runs, narrow bands, tiny max_cells: still a valid alignment, and the monotone
    pairs never outnumber the LCS."""
    ka, kb = keys(a), keys(b)
    result = align(ka, kb, band=band, reorder_window=reorder_window, max_cells=max_cells, max_pairs=max_pairs)
    check_valid(result, ka, kb)
    assert result.band == band
    assert int((~result.reordered).sum()) <= lcs_length(ka, kb)
    if reorder_window == 0:
        assert not result.reordered.any()


# ---------------------------------------------------------------------------------------------
# Cases


@pytest.mark.parametrize("n_a, n_b", [(0, 0), (0, 5), (5, 0)])
def test_empty_inputs(n_a, n_b):
    ka, kb = keys(range(n_a)), keys(range(n_b))
    for result in (align(ka, kb), full_dp_align(ka, kb)):
        check_valid(result, ka, kb)
        assert result.matched == 0
        assert result.gaps_a.tolist() == list(range(n_a)) and result.gaps_b.tolist() == list(range(n_b))


def test_full_dp_align_is_the_textbook_lcs():
    ka, kb = keys([1, 2, 3, 2, 4, 1]), keys([2, 4, 3, 1, 2, 1])
    result = full_dp_align(ka, kb)
    check_valid(result, ka, kb)
    assert result.matched == 4  # e.g. 2 3 2 1
    assert result.anchors == 0 and not result.reordered.any()


def long_run(steps: int, layers: int = 12) -> np.ndarray:
    """A run of `steps` steps: 3 unique events, `layers` layers of 8 events (6 distinct keys)."""
    layer = [0, 1, 1, 1, 2, 3, 4, 5]
    step = [100, 101, 102] + layer * layers
    return keys([s * 1000 + k for s in range(steps) for k in step])


def test_long_runs_with_one_percent_edits_lose_no_true_pair():
    rng = np.random.default_rng(7)
    ka = long_run(200)
    n = ka.size
    keep = rng.random(n) >= 0.01
    at = np.sort(rng.integers(0, n, n // 100))
    kb = np.insert(ka[keep], np.searchsorted(np.flatnonzero(keep), at), FRESH + np.arange(at.size, dtype=np.uint64))
    origin = np.insert(np.flatnonzero(keep), np.searchsorted(np.flatnonzero(keep), at), -1)
    result = align(ka, kb)
    check_valid(result, ka, kb)
    assert result.anchors > 0 and result.windows > 0 and result.max_window > 0
    assert result.matched == int((origin >= 0).sum()), "every surviving event should be matched"
    assert result.gaps_a.size == n - int(keep.sum()) and result.gaps_b.size == at.size


def test_swapped_branches_are_reordered_pairs_not_gaps():
    ka = long_run(30)
    kb = ka.copy()
    # Two independent blocks of 20 events finish in the other order in run B.
    kb[1000:1020], kb[1020:1040] = ka[1020:1040], ka[1000:1020]
    result = align(ka, kb)
    check_valid(result, ka, kb)
    assert result.gaps_a.size == 0 and result.gaps_b.size == 0
    flagged = result.a_idx[result.reordered]
    assert flagged.size >= 1 and np.all((flagged >= 1000) & (flagged < 1040)), flagged


def test_a_reorder_beyond_the_window_leaves_gaps():
    ka = keys(list(range(1000)))
    kb = keys(list(range(900)) + [999] + list(range(900, 999)))  # A's last event, 100 earlier
    assert align(ka, kb).reordered.tolist().count(True) == 1
    result = align(ka, kb, reorder_window=10)
    check_valid(result, ka, kb)
    assert result.gaps_a.tolist() == [999] and result.gaps_b.tolist() == [900]
    assert align(ka, kb, reorder_window=0).gaps_a.tolist() == [999]


def test_a_block_longer_than_the_band_widens_the_band():
    """No anchors (every key repeats) and 300 events inserted in the middle of B between two
    deletes: the band stretches over the length difference and every B event of A's is matched
    in order."""
    ka = keys([k % 7 for k in range(2000)])
    kb = np.concatenate([ka[:500], ka[501:1000], keys(FRESH + np.arange(300)), ka[1000:1500], ka[1501:]])
    result = align(ka, kb, band=8)
    check_valid(result, ka, kb)
    assert result.anchors == 0 and result.max_window > 1000
    assert result.matched == 1998 and not result.reordered.any()
    assert result.gaps_b.tolist() == list(range(999, 1299))


def test_a_run_cut_short_is_solved_by_the_sparse_lcs():
    """Run B stopped partway through a step: its last events face the rest of A, a lopsided
    window over max_cells with no anchor. The sparse LCS matches them where they belong."""
    ka = long_run(40)
    cut = 20 * 99 + 3 + 8 * 5  # step 20, partway through its layers (after the unique events)
    kb = np.delete(ka[:cut], [cut - 30, cut - 17])  # two deletes so it is not a plain prefix
    result = align(ka, kb, max_cells=10_000)
    check_valid(result, ka, kb)
    assert result.sparse_windows >= 1
    assert result.matched == kb.size and not result.reordered.any()
    assert result.a_idx.max() < cut, "B's last events matched beyond where B stopped"


def test_a_window_over_max_cells_is_split_at_keys_unique_inside_it():
    """Keys occur twice in each run (once per half), so the halves hold no global anchor;
    within each half they are unique, and a small max_cells makes align split there."""
    rng = np.random.default_rng(3)
    half = rng.permutation(500).astype(np.uint64)
    ka = np.concatenate([half, keys([10**6]), half])  # 10**6 is the one global anchor
    kb = np.delete(ka, [40, 41, 300, 700])
    result = align(ka, kb, max_cells=2_000)
    check_valid(result, ka, kb)
    assert result.anchors == 1 and result.sub_anchors > 200
    assert result.matched == kb.size and result.gaps_a.tolist() == [40, 41, 300, 700]


def test_a_window_with_too_many_equal_pairs_falls_back_to_the_slope_band():
    """3000 against 2000 events of three keys, with a new key at both ends of B: no anchor, 2
    million equal-key pairs. The slope band solves it in O(short side * band + long side)."""
    ka = keys([k % 3 for k in range(3000)])
    kb = keys([7] + [k % 3 for k in range(1998)] + [7])
    result = align(ka, kb, band=4, max_cells=1_000, max_pairs=1_000)
    check_valid(result, ka, kb)
    assert (result.sparse_windows, result.narrowed_windows) == (0, 1)
    assert result.dp_cells < 2000 * 9 + 3000 + 2000
    assert result.matched == 1998


def test_signed_keys_are_taken_bit_for_bit():
    ka = np.array([-1, 5, -7], dtype=np.int64)
    result = align(ka, ka[::-1].copy())
    assert result.matched == 3


@pytest.mark.parametrize(
    "kwargs, keys_a, message",
    [
        ({}, np.zeros((2, 2), dtype=np.uint64), "1-D"),
        ({}, np.zeros(3, dtype=np.float64), "uint64"),
        ({"band": -1}, np.zeros(3, dtype=np.uint64), "band"),
        ({"reorder_window": -5}, np.zeros(3, dtype=np.uint64), "reorder_window"),
        ({"max_cells": 0}, np.zeros(3, dtype=np.uint64), "max_cells"),
        ({"max_pairs": -1}, np.zeros(3, dtype=np.uint64), "max_pairs"),
    ],
)
def test_bad_input_says_what_to_pass(kwargs, keys_a, message):
    with pytest.raises(BadInput, match=message):
        align(keys_a, np.zeros(3, dtype=np.uint64), **kwargs)


@SETTINGS
@given(values=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 2**64 - 1)), max_size=200))
def test_the_radix_sort_is_a_stable_argsort(values):
    arr = keys(values)
    got, want = _stable_order(arr), np.argsort(arr, kind="stable")
    assert np.array_equal(got, want), f"radix order {got} vs numpy's stable argsort {want}"
