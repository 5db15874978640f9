"""Tolerant alignment of two event streams by their keys.

`align` pairs the events of run A with the events of run B so that the compare engine can look
for the first pair whose tensor digests differ. It works on one uint64 key per event (the caller
hashes step, phase, boundary, module type and tensor shapes/dtypes into it) and knows nothing
else: not what a key means, not digests, not ranks or storage. Equal keys are candidate matches.

The algorithm (docs/ALIGNMENT.md has the long form):

1. Anchors: keys that occur exactly once in A and once in B, paired, and the longest chain of
   pairs increasing in both runs kept (patience diff).
2. Between consecutive anchors, a banded LCS dynamic programme matches the rest. The band holds
   the diagonals of the window's two corners plus `band` on either side. A window whose band
   exceeds `max_cells` is split again at keys unique inside it; one that cannot be split is
   solved exactly from its equal-key pairs (Hunt-Szymanski) when they are few, else in a band
   that follows the window's slope, which costs O(short side * band + long side).
3. Reorder pass: unmatched A and B events with equal keys within `reorder_window` of each other
   are paired nearest first and flagged `reordered`, so a local reorder of independent branches
   gives matched pairs, not two gaps.

Cost is O((n + m) * band) plus O(k log k) for k anchor candidates for two similar runs (every
sort is a linear radix sort); memory is linear. Every hot loop is a single-threaded
`@njit(cache=True)` function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from bitguard.errors import BadInput

# Moves stored by the DP traceback: match A[i-1] with B[j-1], skip A[i-1], skip B[j-1], skip
# both (a mismatch; without it a band of width one, band=0 on a square window, has no path).
_DIAG = 0
_UP = 1
_LEFT = 2
_BOTH = 3

# Band shapes. _KBAND: the diagonals j - i between the window's two corners, widened by `band`
# on both sides, so a block inserted in one run still fits. _SLOPE: `band` around the line from
# corner to corner; narrower for lopsided windows, used when _KBAND would exceed max_cells.
_KBAND = 0
_SLOPE = 1

# Slots of the statistics array that _align_monotone returns, and their number.
_ST_ANCHORS, _ST_SUB_ANCHORS, _ST_WINDOWS, _ST_SPARSE, _ST_NARROWED, _ST_CELLS, _ST_MAX_WINDOW = range(7)
_N_STATS = 7

DEFAULT_MAX_CELLS = 1 << 23
"""DP cells (one byte of traceback each) above which a window is split again before solving."""

DEFAULT_MAX_PAIRS = 1 << 20
"""Equal-key pairs (24 bytes each) up to which a window over max_cells is solved by the sparse
LCS; above it the slope band is used."""


@dataclass
class Alignment:
    """The pairing of two event streams; every position is in exactly one pair or one gap list."""

    a_idx: np.ndarray  # int64: positions in A of matched pairs, strictly ascending
    b_idx: np.ndarray  # int64: the matching positions in B, same length as a_idx
    reordered: np.ndarray  # bool per pair: paired by the reorder pass (breaks monotonicity)
    gaps_a: np.ndarray  # int64: positions in A left unmatched (present only in A), ascending
    gaps_b: np.ndarray  # int64: positions in B left unmatched (present only in B), ascending
    band: int  # band half-width the DP used
    max_window: int  # largest DP window solved: max of its A and B lengths after trimming
    anchors: int  # anchor pairs over the whole runs (keys unique in both A and B)
    sub_anchors: int = 0  # further anchor pairs from splitting windows over max_cells
    windows: int = 0  # DP windows solved
    sparse_windows: int = 0  # windows over max_cells solved by the exact sparse LCS instead
    narrowed_windows: int = 0  # windows over max_cells solved in the slope band instead
    dp_cells: int = 0  # DP cells computed, all windows together

    @property
    def matched(self) -> int:
        """Number of matched pairs, monotone and reordered."""
        return int(self.a_idx.size)


def align(
    keys_a: np.ndarray,
    keys_b: np.ndarray,
    *,
    band: int = 64,
    reorder_window: int = 256,
    max_cells: int = DEFAULT_MAX_CELLS,
    max_pairs: int = DEFAULT_MAX_PAIRS,
) -> Alignment:
    """Align two key streams: anchors, banded DP between them, then the reorder pass.

    `band` is how far (in events) the DP may stray from a window's diagonals; `reorder_window`
    how far apart (in B positions, after projecting A through the monotone alignment) two
    unmatched events with equal keys may be and still be paired; 0 turns the pass off.
    `max_cells` bounds one window's band DP before it is split again or solved otherwise;
    `max_pairs` bounds the sparse LCS tried next (see DEFAULT_MAX_CELLS, DEFAULT_MAX_PAIRS).
    """
    ka = _as_keys(keys_a, "keys_a")
    kb = _as_keys(keys_b, "keys_b")
    for name, value, least in (("band", band, 0), ("reorder_window", reorder_window, 0),
                               ("max_cells", max_cells, 1), ("max_pairs", max_pairs, 0)):
        if int(value) < least:
            raise BadInput(f"align: {name}={value} is below {least}; pass {name} >= {least}.")
    match_a, matched_b, stats = _align_monotone(ka, kb, int(band), int(max_cells), int(max_pairs))
    reordered = np.zeros(ka.size, dtype=np.bool_)
    if reorder_window > 0:
        _reorder_pass(ka, kb, match_a, matched_b, int(reorder_window), reordered)
    return _result(match_a, matched_b, reordered, int(band), stats)


def full_dp_align(keys_a: np.ndarray, keys_b: np.ndarray) -> Alignment:
    """Plain O(n*m) LCS alignment, no anchors, no band, no reorder pass: the baseline for tests
    and benchmarks. Runs the same DP kernel as `align` with a band that covers every cell."""
    ka = _as_keys(keys_a, "keys_a")
    kb = _as_keys(keys_b, "keys_b")
    n, m = ka.size, kb.size
    match_a = np.full(n, -1, dtype=np.int64)
    stats = np.zeros(_N_STATS, dtype=np.int64)
    if n and m:
        stats[_ST_CELLS] = _solve_window(ka, kb, 0, n, 0, m, max(n, m), _KBAND, match_a)
        stats[_ST_WINDOWS] = 1
        stats[_ST_MAX_WINDOW] = max(n, m)
    matched_b = np.zeros(m, dtype=np.bool_)
    matched_b[match_a[match_a >= 0]] = True
    return _result(match_a, matched_b, np.zeros(n, dtype=np.bool_), max(n, m), stats)


def _as_keys(keys: np.ndarray, name: str) -> np.ndarray:
    """The keys as a contiguous 1-D uint64 array; signed 64-bit keys are reinterpreted bit for bit."""
    arr = np.asarray(keys)
    if arr.ndim != 1:
        raise BadInput(f"align: {name} has shape {arr.shape}; pass a 1-D array of uint64 keys.")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype == np.int64:
        arr = arr.view(np.uint64)
    if arr.dtype != np.uint64:
        raise BadInput(f"align: {name} has dtype {arr.dtype}; pass uint64 keys (one hash per event).")
    return np.ascontiguousarray(arr)


def _result(match_a, matched_b, reordered, band, stats) -> Alignment:
    a_idx = np.flatnonzero(match_a >= 0).astype(np.int64)
    return Alignment(
        a_idx=a_idx,
        b_idx=match_a[a_idx],
        reordered=reordered[a_idx],
        gaps_a=np.flatnonzero(match_a < 0).astype(np.int64),
        gaps_b=np.flatnonzero(~matched_b).astype(np.int64),
        band=band,
        max_window=int(stats[_ST_MAX_WINDOW]),
        anchors=int(stats[_ST_ANCHORS]),
        sub_anchors=int(stats[_ST_SUB_ANCHORS]),
        windows=int(stats[_ST_WINDOWS]),
        sparse_windows=int(stats[_ST_SPARSE]),
        narrowed_windows=int(stats[_ST_NARROWED]),
        dp_cells=int(stats[_ST_CELLS]),
    )


# ---------------------------------------------------------------------------------------------
# Anchors


@njit(cache=True)
def _stable_order(values):
    """Stable argsort of a uint64 array: LSD radix sort, one byte a pass, skipping the bytes that
    are the same in every value; insertion sort below 33 values. Every sort here goes through it:
    2-4x faster than Numba's mergesort on hashed keys, 50x on few distinct keys, and far less to
    compile."""
    n = values.size
    order = np.arange(n)
    if n <= 32:
        for t in range(1, n):
            item = order[t]
            value = values[item]
            u = t - 1
            while u >= 0 and values[order[u]] > value:
                order[u + 1] = order[u]
                u -= 1
            order[u + 1] = item
        return order
    counts = np.zeros((8, 256), dtype=np.int64)
    for t in range(n):
        value = values[t]
        for p in range(8):
            counts[p, np.int64((value >> np.uint64(8 * p)) & np.uint64(255))] += 1
    spare = np.empty(n, dtype=np.int64)
    for p in range(8):
        constant = False
        for d in range(256):
            constant = constant or counts[p, d] == n
        if constant:
            continue
        start = 0
        for d in range(256):
            c = counts[p, d]
            counts[p, d] = start
            start += c
        shift = np.uint64(8 * p)
        for t in range(n):
            item = order[t]
            d = np.int64((values[item] >> shift) & np.uint64(255))
            spare[counts[p, d]] = item
            counts[p, d] += 1
        order, spare = spare, order
    return order


@njit(cache=True)
def _unique_keys(keys, lo, hi):
    """Keys occurring exactly once in keys[lo:hi], ascending, with their positions."""
    w = hi - lo
    order = _stable_order(keys[lo:hi])
    out_keys = np.empty(w, dtype=np.uint64)
    out_pos = np.empty(w, dtype=np.int64)
    count = 0
    s = 0
    while s < w:
        k = keys[lo + order[s]]
        e = s + 1
        while e < w and keys[lo + order[e]] == k:
            e += 1
        if e == s + 1:
            out_keys[count] = k
            out_pos[count] = lo + order[s]
            count += 1
        s = e
    return out_keys[:count], out_pos[:count]


@njit(cache=True)
def _longest_increasing(pa, pb):
    """The longest subsequence of pairs (pa ascending) whose pb is strictly increasing."""
    k = pb.size
    tails = np.empty(k, dtype=np.int64)  # tails[L]: pair ending the best chain of length L + 1
    prev = np.empty(k, dtype=np.int64)
    length = 0
    for t in range(k):
        v = pb[t]
        lo = 0
        hi = length
        while lo < hi:
            mid = (lo + hi) >> 1
            if pb[tails[mid]] < v:
                lo = mid + 1
            else:
                hi = mid
        prev[t] = tails[lo - 1] if lo > 0 else -1
        tails[lo] = t
        if lo == length:
            length += 1
    out_a = np.empty(length, dtype=np.int64)
    out_b = np.empty(length, dtype=np.int64)
    t = tails[length - 1] if length > 0 else -1
    for r in range(length - 1, -1, -1):
        out_a[r] = pa[t]
        out_b[r] = pb[t]
        t = prev[t]
    return out_a, out_b


@njit(cache=True)
def _anchor_chain(ka, kb, a_lo, a_hi, b_lo, b_hi):
    """Anchor pairs of the window: keys unique on both sides, longest chain increasing in both."""
    uka, upa = _unique_keys(ka, a_lo, a_hi)
    ukb, upb = _unique_keys(kb, b_lo, b_hi)
    partner = np.full(a_hi - a_lo, -1, dtype=np.int64)  # B position of A's anchor key, by A
    count = 0
    i = 0
    j = 0
    while i < uka.size and j < ukb.size:
        if uka[i] < ukb[j]:
            i += 1
        elif uka[i] > ukb[j]:
            j += 1
        else:
            partner[upa[i] - a_lo] = upb[j]
            count += 1
            i += 1
            j += 1
    pa = np.empty(count, dtype=np.int64)
    pb = np.empty(count, dtype=np.int64)
    count = 0
    for i in range(partner.size):
        if partner[i] >= 0:
            pa[count] = a_lo + i
            pb[count] = partner[i]
            count += 1
    return _longest_increasing(pa, pb)


# ---------------------------------------------------------------------------------------------
# Banded DP


@njit(cache=True)
def _row_bounds(i, n, m, band, shape):
    """Columns [lo, hi] of row i in the band; lo and hi never decrease from row to row, and each
    row's lo is at most the previous row's hi + 1, so every cell in the band is reachable
    (from the row above, or diagonally with _BOTH)."""
    if shape == _KBAND:
        lo = i + min(0, m - n) - band
        hi = i + max(0, m - n) + band
    else:
        lo = (i * m) // n - band
        hi = ((i + 1) * m) // n + band
    return max(lo, 0), min(hi, m)


@njit(cache=True)
def _band_cells(n, m, band, shape):
    """Cells of an n x m window's band (rows 0..n, columns 0..m)."""
    cells = 0
    for i in range(n + 1):
        lo, hi = _row_bounds(i, n, m, band, shape)
        cells += hi - lo + 1
    return cells


@njit(cache=True)
def _edge_cell(ky, x, y0, j, lo, p_lo, p_hi, prev, cur, tb, base):
    """One DP cell with every neighbour checked against the band (row lo..., previous row
    p_lo..p_hi); priority on ties: match, skip A, skip B, skip both."""
    best = -1
    move = _BOTH
    has_diag = j >= 1 and p_lo <= j - 1 <= p_hi
    if has_diag and ky[y0 + j - 1] == x:
        best = prev[j - 1] + 1
        move = _DIAG
    if j <= p_hi and prev[j] > best:  # j >= p_lo: lo never decreases
        best = prev[j]
        move = _UP
    if j > lo and cur[j - 1] > best:
        best = cur[j - 1]
        move = _LEFT
    if has_diag and prev[j - 1] > best:  # only where neither neighbour is in the band
        best = prev[j - 1]
        move = _BOTH
    cur[j] = best
    tb[base + j] = move


@njit(cache=True)
def _solve_window(ka, kb, a0, n, b0, m, band, shape, match_a):
    """LCS of ka[a0:a0+n] and kb[b0:b0+m] inside the band; writes the matches into match_a
    (A position -> B position) and returns the number of cells computed. The shorter side
    runs along the rows, so a lopsided window in the slope band costs O(short * band + long)."""
    if n > m:
        kx, ky, x0, nx, y0, ny = kb, ka, b0, m, a0, n
    else:
        kx, ky, x0, nx, y0, ny = ka, kb, a0, n, b0, m
    # One call with run-time arguments: constant ones would make Numba compile a copy per value.
    return _solve_rows(kx, ky, x0, nx, y0, ny, band, shape, match_a, n > m)


@njit(cache=True)
def _solve_rows(kx, ky, x0, n, y0, m, band, shape, match_a, x_is_b):
    """The DP of _solve_window with kx[x0:x0+n] along the rows and ky[y0:y0+m] along the
    columns; x_is_b says the rows are run B, so matches are written into match_a transposed."""
    row_lo = np.empty(n + 1, dtype=np.int64)
    row_off = np.empty(n + 2, dtype=np.int64)  # row i's cells start at row_off[i] in tb
    row_off[0] = 0
    for i in range(n + 1):
        lo, hi = _row_bounds(i, n, m, band, shape)
        row_lo[i] = lo
        row_off[i + 1] = row_off[i] + hi - lo + 1
    cells = row_off[n + 1]
    tb = np.empty(cells, dtype=np.uint8)
    prev = np.empty(m + 1, dtype=np.int32)
    cur = np.empty(m + 1, dtype=np.int32)
    p_lo = row_lo[0]  # 0, read from the array so that Numba sees a run-time int, not a constant
    p_hi = row_off[1] - 1
    for j in range(p_hi + 1):
        prev[j] = 0
        tb[j] = _LEFT
    for i in range(1, n + 1):
        lo = row_lo[i]
        hi = lo + row_off[i + 1] - row_off[i] - 1
        base = row_off[i] - lo
        x = kx[x0 + i - 1]
        # The first cell and those right of the row above need bounds checks; the cells in
        # between have all three neighbours in the band and run without them.
        mid_hi = min(hi, p_hi)
        _edge_cell(ky, x, y0, lo, lo, p_lo, p_hi, prev, cur, tb, base)
        for j in range(lo + 1, mid_hi + 1):
            up = prev[j]
            left = cur[j - 1]
            if ky[y0 + j - 1] == x and prev[j - 1] + 1 >= up and prev[j - 1] + 1 >= left:
                cur[j] = prev[j - 1] + 1
                tb[base + j] = _DIAG
            elif up >= left:
                cur[j] = up
                tb[base + j] = _UP
            else:
                cur[j] = left
                tb[base + j] = _LEFT
        for j in range(max(lo + 1, mid_hi + 1), hi + 1):
            _edge_cell(ky, x, y0, j, lo, p_lo, p_hi, prev, cur, tb, base)
        prev, cur = cur, prev
        p_lo = lo
        p_hi = hi
    i = n
    j = m
    while i > 0 and j > 0:
        move = tb[row_off[i] - row_lo[i] + j]
        if move == _DIAG:
            if x_is_b:
                match_a[y0 + j - 1] = x0 + i - 1
            else:
                match_a[x0 + i - 1] = y0 + j - 1
            i -= 1
            j -= 1
        elif move == _UP:
            i -= 1
        elif move == _LEFT:
            j -= 1
        else:
            i -= 1
            j -= 1
    return cells


@njit(cache=True)
def _sparse_window(ka, kb, a0, n, b0, m, limit, match_a):
    """Exact LCS of ka[a0:a0+n] and kb[b0:b0+m] from their equal-key pairs alone (Hunt and
    Szymanski): O((r + n) log m) time and O(r) memory for r equal-key pairs, whatever the shape
    of the window. Returns False, having written nothing, when r exceeds `limit`.

    It rescues the lopsided windows that the wide band cannot afford and that have no anchor:
    a run cut short (B's last events against all the rest of A), a block missing from one run.
    """
    sub_b = kb[b0 : b0 + m]
    order_b = _stable_order(sub_b)  # equal keys keep B's order
    sorted_b = np.empty(m, dtype=np.uint64)
    for t in range(m):
        sorted_b[t] = sub_b[order_b[t]]
    first = np.empty(n, dtype=np.int64)  # A offset i matches B offsets order_b[first[i]:last[i]]
    last = np.empty(n, dtype=np.int64)
    pairs = 0
    for i in range(n):
        first[i] = np.searchsorted(sorted_b, ka[a0 + i], side="left")
        last[i] = np.searchsorted(sorted_b, ka[a0 + i], side="right")
        pairs += last[i] - first[i]
        if pairs > limit:
            return False
    # thresh[k]: smallest B offset ending a common subsequence of length k + 1 found so far;
    # node[k]: the chain that ends there (node_a, node_b, node_prev hold the chains).
    thresh = np.empty(min(n, m), dtype=np.int64)
    node = np.empty(min(n, m), dtype=np.int64)
    node_a = np.empty(pairs, dtype=np.int64)
    node_b = np.empty(pairs, dtype=np.int64)
    node_prev = np.empty(pairs, dtype=np.int64)
    nodes = 0
    length = 0
    for i in range(n):
        for t in range(last[i] - 1, first[i] - 1, -1):  # B offsets descending, so one A event
            j = order_b[t]  # never extends a chain it just ended itself
            lo = 0
            hi = length
            while lo < hi:
                mid = (lo + hi) >> 1
                if thresh[mid] < j:
                    lo = mid + 1
                else:
                    hi = mid
            if lo < length and thresh[lo] == j:
                continue
            thresh[lo] = j
            node_a[nodes] = i
            node_b[nodes] = j
            node_prev[nodes] = node[lo - 1] if lo > 0 else -1
            node[lo] = nodes
            nodes += 1
            if lo == length:
                length += 1
    t = node[length - 1] if length > 0 else -1
    while t >= 0:
        match_a[a0 + node_a[t]] = b0 + node_b[t]
        t = node_prev[t]
    return True


# ---------------------------------------------------------------------------------------------
# Monotone alignment: anchors, windows, DP


@njit(cache=True)
def _split_at_anchors(ka, kb, a_lo, a_hi, b_lo, b_hi, match_a, stack):
    """Match the window's anchor chain and push the windows between the anchors (last first,
    so they pop in order). Returns the number of anchors; 0, doing nothing, when there is none."""
    pa, pb = _anchor_chain(ka, kb, a_lo, a_hi, b_lo, b_hi)
    if pa.size == 0:
        return 0
    next_a = a_hi
    next_b = b_hi
    for r in range(pa.size - 1, -1, -1):
        match_a[pa[r]] = pb[r]
        stack.append((pa[r] + 1, next_a, pb[r] + 1, next_b, False))
        next_a = pa[r]
        next_b = pb[r]
    stack.append((a_lo, next_a, b_lo, next_b, False))
    return pa.size


@njit(cache=True)
def _align_monotone(ka, kb, band, max_cells, max_pairs):
    """Monotone alignment of ka and kb: (match_a, matched_b, stats) where match_a[i] is the B
    position matched with A position i or -1, and stats holds the _ST_* counters."""
    n = ka.size
    m = kb.size
    match_a = np.full(n, -1, dtype=np.int64)
    stats = np.zeros(_N_STATS, dtype=np.int64)
    stack = [(0, n, 0, m, True)]  # windows [a_lo, a_hi) x [b_lo, b_hi); True: the whole runs
    while len(stack) > 0:
        a_lo, a_hi, b_lo, b_hi, whole = stack.pop()
        if whole:  # anchors are keys unique in the whole runs, found before any trimming
            found = _split_at_anchors(ka, kb, a_lo, a_hi, b_lo, b_hi, match_a, stack)
            if found > 0:
                stats[_ST_ANCHORS] += found
                continue
        # A common prefix or suffix belongs to some LCS: match it without a DP.
        while a_lo < a_hi and b_lo < b_hi and ka[a_lo] == kb[b_lo]:
            match_a[a_lo] = b_lo
            a_lo += 1
            b_lo += 1
        while a_lo < a_hi and b_lo < b_hi and ka[a_hi - 1] == kb[b_hi - 1]:
            match_a[a_hi - 1] = b_hi - 1
            a_hi -= 1
            b_hi -= 1
        wn = a_hi - a_lo
        wm = b_hi - b_lo
        if wn == 0 or wm == 0:
            continue
        cells = _band_cells(wn, wm, band, _KBAND)
        if cells > max_cells and not whole:  # (the whole runs were just searched for anchors)
            found = _split_at_anchors(ka, kb, a_lo, a_hi, b_lo, b_hi, match_a, stack)
            if found > 0:
                stats[_ST_SUB_ANCHORS] += found
                continue
        stats[_ST_WINDOWS] += 1
        stats[_ST_MAX_WINDOW] = max(stats[_ST_MAX_WINDOW], wn, wm)
        if cells > max_cells and _sparse_window(ka, kb, a_lo, wn, b_lo, wm, max_pairs, match_a):
            stats[_ST_SPARSE] += 1
            continue
        shape = _KBAND if cells <= max_cells else _SLOPE
        stats[_ST_NARROWED] += shape == _SLOPE
        stats[_ST_CELLS] += _solve_window(ka, kb, a_lo, wn, b_lo, wm, band, shape, match_a)
    matched_b = np.zeros(m, dtype=np.bool_)
    for i in range(n):
        if match_a[i] >= 0:
            matched_b[match_a[i]] = True
    return match_a, matched_b, stats


# ---------------------------------------------------------------------------------------------
# Reorder pass


@njit(cache=True)
def _heap_push(heap, size, value):
    heap[size] = value
    c = size
    while c > 0:
        p = (c - 1) >> 1
        if heap[p] <= heap[c]:
            break
        heap[p], heap[c] = heap[c], heap[p]
        c = p
    return size + 1


@njit(cache=True)
def _heap_pop(heap, size):
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    c = 0
    while True:
        small = c
        left = 2 * c + 1
        if left < size and heap[left] < heap[small]:
            small = left
        if left + 1 < size and heap[left + 1] < heap[small]:
            small = left + 1
        if small == c:
            break
        heap[small], heap[c] = heap[c], heap[small]
        c = small
    return top, size


@njit(cache=True)
def _group_order(key, coord, from_a, pos):
    """Order of the items by key, then coordinate, then B before A, then position."""
    order = _stable_order(key)
    span = max(pos.max(), 0) + 1
    s = 0
    while s < order.size:
        e = s + 1
        while e < order.size and key[order[e]] == key[order[s]]:
            e += 1
        if e - s > 1:
            group = order[s:e].copy()
            tie = np.empty(e - s, dtype=np.uint64)  # all >= 0; unsigned to share _stable_order
            for t in range(e - s):
                it = group[t]
                tie[t] = (coord[it] * 2 + from_a[it]) * span + pos[it]
            within = _stable_order(tie)
            for t in range(e - s):  # loops, not fancy indexing: much less to compile
                order[s + t] = group[within[t]]
        s = e
    return order


@njit(cache=True)
def _reorder_pass(ka, kb, match_a, matched_b, window, reordered):
    """Pair unmatched A and B events with equal keys, nearest first, at most `window` apart.

    Distances are in B positions: an unmatched A event at i is projected to b + (i - a), where
    (a, b) is the last monotone pair before it, so drift from earlier inserts/deletes does not
    count. Among the unmatched events of one key sorted by that coordinate, the closest A-B pair
    is always adjacent, so a heap of adjacent pairs yields the greedy matching in O(k log k).
    Updates match_a, matched_b and reordered in place; returns the number of pairs made.
    """
    n = ka.size
    m = kb.size
    n_free_a = 0
    for i in range(n):
        if match_a[i] < 0:
            n_free_a += 1
    n_free_b = 0
    for j in range(m):
        if not matched_b[j]:
            n_free_b += 1
    if n_free_a == 0 or n_free_b == 0:
        return 0
    total = n_free_a + n_free_b
    key = np.empty(total, dtype=np.uint64)
    coord = np.empty(total, dtype=np.int64)
    pos = np.empty(total, dtype=np.int64)
    from_a = np.empty(total, dtype=np.bool_)
    c = 0
    last_a = -1
    last_b = -1
    for i in range(n):
        if match_a[i] >= 0:
            last_a = i
            last_b = match_a[i]
        else:
            key[c] = ka[i]
            coord[c] = last_b + (i - last_a)
            pos[c] = i
            from_a[c] = True
            c += 1
    for j in range(m):
        if not matched_b[j]:
            key[c] = kb[j]
            coord[c] = j
            pos[c] = j
            from_a[c] = False
            c += 1
    order = _group_order(key, coord, from_a, pos)
    s_key = np.empty(total, dtype=np.uint64)
    s_coord = np.empty(total, dtype=np.int64)
    s_pos = np.empty(total, dtype=np.int64)
    s_from_a = np.empty(total, dtype=np.bool_)
    for t in range(total):
        s_key[t] = key[order[t]]
        s_coord[t] = coord[order[t]]
        s_pos[t] = pos[order[t]]
        s_from_a[t] = from_a[order[t]]
    key, coord, pos, from_a = s_key, s_coord, s_pos, s_from_a

    window = min(window, n + m + 1)  # no distance is larger; keeps dist * total in int64
    nxt = np.arange(1, total + 1)
    nxt[total - 1] = -1
    prv = np.arange(-1, total - 1)
    alive = np.ones(total, dtype=np.bool_)
    heap = np.empty(2 * total, dtype=np.int64)  # entries dist * total + left item
    size = 0
    for t in range(total - 1):
        u = t + 1
        d = abs(coord[u] - coord[t])
        if key[t] == key[u] and from_a[t] != from_a[u] and d <= window:
            size = _heap_push(heap, size, d * total + t)
    made = 0
    while size > 0:
        entry, size = _heap_pop(heap, size)
        d = entry // total
        t = entry % total
        if not alive[t]:
            continue
        u = nxt[t]
        if u < 0 or key[t] != key[u] or from_a[t] == from_a[u] or abs(coord[u] - coord[t]) != d:
            continue  # stale: t's neighbour changed since this entry was pushed
        ia = pos[t] if from_a[t] else pos[u]
        jb = pos[u] if from_a[t] else pos[t]
        match_a[ia] = jb
        matched_b[jb] = True
        reordered[ia] = True
        made += 1
        alive[t] = False
        alive[u] = False
        left = prv[t]
        right = nxt[u]
        if left >= 0:
            nxt[left] = right
        if right >= 0:
            prv[right] = left
        if left >= 0 and right >= 0:
            d = abs(coord[right] - coord[left])
            if key[left] == key[right] and from_a[left] != from_a[right] and d <= window:
                size = _heap_push(heap, size, d * total + left)
    return made
