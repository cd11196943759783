"""Small @triton.jit helpers shared by the kernels."""
import triton
import triton.language as tl


@triton.jit
def l2norm_rows(x):
  """Normalises the last axis of a float32 block: x / sqrt(sum(x^2) + 1e-6).

  The epsilon keeps a zero row (a folded decode step's empty query) at exactly zero.
  """
  return x / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6)


@triton.jit
def chunk_span(chunk_desc, cu_seqlens, i_d, M: tl.constexpr, BT: tl.constexpr):
  """Descriptor i_d of a chunked stream with M rows per token (docs/algorithm.md §5.3).

  Returns (i_n, row0, n): the sequence (negative for a padding descriptor, whose program should
  return at once), the chunk's first row on the stream as an int64 (row * stride overflows int32
  on long packed batches; offsets inside the chunk do not) and its valid rows (at most BT).
  """
  i_n = tl.load(chunk_desc + 2 * i_d)
  i_c = tl.load(chunk_desc + 2 * i_d + 1)
  i_s = tl.maximum(i_n, 0)  # a padding descriptor reads sequence 0's bounds, unused
  bos = tl.load(cu_seqlens + i_s).to(tl.int64) * M
  eos = tl.load(cu_seqlens + i_s + 1).to(tl.int64) * M
  row0 = bos + i_c * BT
  return i_n, row0, tl.minimum(eos - row0, BT).to(tl.int32)


@triton.jit
def query_rows(row0, n, M: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr):
  """The rows of an expanded-stream chunk (first row row0, n valid rows; chunk_span) that hold a
  query, q~ and do~ sitting on each token's last copy (docs/algorithm.md §13.1), as BQ entries:
  (their chunk rows, their mask, their tokens on the token stream). With BQ = BT / M (M divides
  BT, the chunk starts on a token) entry j is token row0 / M + j, on chunk row j M + M - 1, so
  the queries and output cotangents of a chunk are BQ rows, not BT rows of which M - 1 in M are
  zero; with BQ = BT, every row, masked to the last copies. BQ comes from query_block."""
  o_j = tl.arange(0, BQ)
  if BQ < BT:
    r_q = o_j * M + (M - 1)
    return r_q, r_q < n, row0 // M + o_j
  row = row0 + o_j
  return o_j, (o_j < n) & (row % M == M - 1), row // M


@triton.constexpr_function
def query_block(M, BT):
  """query_rows' BQ: BT / M where M divides BT and a chunk holds at least 16 tokens (a dot's
  smallest K), else BT."""
  return BT // M if BT % M == 0 and BT // M >= 16 else BT


@triton.jit
def chunk_decays(g, row0, n, i_hv, HV: tl.constexpr, M: tl.constexpr, BT: tl.constexpr):
  """Stage 1 for one chunk of a stream with M rows per token and one value head: the chunk-local
  inclusive cumsum of g~[r] = g[r // M] on each token's first copy (0 on the others), in log2
  units (docs/algorithm.md §4.3); chunk_kkt (expanded stream) and chunk_o (token stream) call it. g
  is the [T, HV] float32 token stream; row0 and n as chunk_span returns them. Rows at or past n hold
  the chunk's total; callers mask them."""
  o_r = tl.arange(0, BT)
  row = row0 + o_r
  b_g = tl.load(g + (row // M) * HV + i_hv, mask=(o_r < n) & (row % M == 0), other=0.)
  # Scaled after the sum, so every kernel downstream can use exp2.
  return tl.cumsum(b_g.to(tl.float32), axis=0) * 1.4426950216


@triton.jit
def decode_program(NV: tl.constexpr, HV: tl.constexpr, H: tl.constexpr):
  """The flat program id of a decode grid (N * HV * NV programs, V blocks innermost) as
  (V block, sequence, value head, key head): one axis, so N * HV has no 65535 cap."""
  i_flat = tl.program_id(0)
  i_v = i_flat % NV
  i_nh = i_flat // NV
  i_hv = i_nh % HV
  return i_v, i_nh // HV, i_hv, i_hv // (HV // H)
