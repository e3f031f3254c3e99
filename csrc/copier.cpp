// offload._copier: CPU-side byte movers for the KV offload connector.
//
// Everything here works on raw addresses passed from Python as ints, so the
// module needs no torch headers and builds in seconds.  The Python side
// (offload/copier.py) owns validation against tensor shapes; this file only
// checks what it can know: sizes it is told, and sign/range of indices.
// All heavy functions release the GIL.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#endif

#include "ghash.h"
#include "page_layout.h"

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------- CRC-32C --
// All internal functions work on the raw CRC register (no pre/post
// inversion); the public entry points apply ~seed / ~result so that seeds
// chain: crc32c(b, seed=crc32c(a)) == crc32c(a + b).

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, reflected

struct SoftTables {
  uint32_t t[8][256];
  SoftTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};
const SoftTables& soft_tables() {
  static const SoftTables tables;
  return tables;
}

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // unaligned-safe; compiles to a plain load
  return v;
}

// Slice-by-8 (little-endian hosts only, which is all we target).
uint32_t crc_raw_soft(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& T = soft_tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
    --n;
  }
  while (n >= 8) {
    uint64_t v = load_u64(p) ^ crc;
    crc = T[7][v & 0xFF] ^ T[6][(v >> 8) & 0xFF] ^ T[5][(v >> 16) & 0xFF] ^
          T[4][(v >> 24) & 0xFF] ^ T[3][(v >> 32) & 0xFF] ^ T[2][(v >> 40) & 0xFF] ^
          T[1][(v >> 48) & 0xFF] ^ T[0][(v >> 56) & 0xFF];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
// The crc32 instruction has 3-cycle latency but 1/cycle throughput, so one
// dependency chain runs at 1/3 of peak.  We hash three independent lanes of
// kLane bytes and merge them with a precomputed "append kLane zero bytes"
// operator (the CRC register update is linear over GF(2)).
constexpr size_t kLane = 8192;

struct ShiftTable {
  uint32_t t[4][256];  // byte-sliced 32x32 GF(2) matrix: state -> state after kLane zeros
  ShiftTable() {
    uint32_t col[32];
    static const uint8_t zeros[kLane] = {};
    for (int b = 0; b < 32; ++b) col[b] = crc_raw_soft(1u << b, zeros, kLane);
    for (int k = 0; k < 4; ++k)
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t r = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (v & (1u << bit)) r ^= col[8 * k + bit];
        t[k][v] = r;
      }
  }
  uint32_t shift(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
  }
};
const ShiftTable& shift_table() {
  static const ShiftTable table;
  return table;
}

__attribute__((target("sse4.2"))) uint32_t crc_raw_hw(uint32_t crc, const uint8_t* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(crc, *p++);
    --n;
  }
  if (n >= 3 * kLane) {
    const ShiftTable& st = shift_table();
    while (n >= 3 * kLane) {
      uint64_t c0 = crc, c1 = 0, c2 = 0;
      const uint8_t* p1 = p + kLane;
      const uint8_t* p2 = p + 2 * kLane;
      for (size_t i = 0; i < kLane; i += 8) {
        c0 = _mm_crc32_u64(c0, load_u64(p + i));
        c1 = _mm_crc32_u64(c1, load_u64(p1 + i));
        c2 = _mm_crc32_u64(c2, load_u64(p2 + i));
      }
      crc = st.shift(st.shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1)) ^
            static_cast<uint32_t>(c2);
      p += 3 * kLane;
      n -= 3 * kLane;
    }
  }
  uint64_t c = crc;
  while (n >= 8) {
    c = _mm_crc32_u64(c, load_u64(p));
    p += 8;
    n -= 8;
  }
  crc = static_cast<uint32_t>(c);
  while (n--) crc = _mm_crc32_u8(crc, *p++);
  return crc;
}

bool have_sse42() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return ok;
}

// Carry-less multiply folding (Intel, "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ", 2009), for CPUs where the crc32 instruction
// issues one per 3 cycles (AMD Zen 1-2: the 3-lane path above runs at about
// 5 GB/s there, a fifth of a load's CPU). Four 16-byte accumulators step 64
// bytes at a time; the last 16 bytes are reduced with two crc32 instructions,
// so no Barrett constants are needed. Same CRC-32C value, no format change.
//
// Reflected operands: a 64-bit lane bit i is the coefficient of x^(63-i),
// and pclmul's 128-bit product is then x*A*B, hence the "- 1" in the
// exponents below.  A 16-byte block moved D bytes towards the end of the
// buffer is its low lane times x^(8D+64) plus its high lane times x^(8D).
uint32_t xpow_mod(size_t e) {  // x^e mod P as a CRC register (bit b: x^(31-b))
  uint32_t r = 0x80000000u;
  while (e--) r = (r >> 1) ^ (kPoly & (0u - (r & 1u)));
  return r;
}

struct FoldKeys {
  uint64_t k64[2], k16[2];  // {low lane, high lane} multipliers for D = 64 and D = 16
  FoldKeys() {
    const auto key = [](size_t e) { return static_cast<uint64_t>(xpow_mod(e)) << 32; };
    k64[0] = key(8 * 64 + 64 - 1);
    k64[1] = key(8 * 64 - 1);
    k16[0] = key(8 * 16 + 64 - 1);
    k16[1] = key(8 * 16 - 1);
  }
};
const FoldKeys& fold_keys() {
  static const FoldKeys keys;
  return keys;
}

__attribute__((target("pclmul,sse4.2"))) inline __m128i fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

constexpr size_t kClmulMin = 256;  // below it the crc32 instruction is faster

__attribute__((target("pclmul,sse4.2"))) uint32_t crc_raw_clmul(uint32_t crc, const uint8_t* p,
                                                                 size_t n) {
  if (n < kClmulMin) return crc_raw_hw(crc, p, n);
  const FoldKeys& fk = fold_keys();
  const __m128i k64 = _mm_set_epi64x(static_cast<long long>(fk.k64[1]), static_cast<long long>(fk.k64[0]));
  const __m128i k16 = _mm_set_epi64x(static_cast<long long>(fk.k16[1]), static_cast<long long>(fk.k16[0]));
  auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  // The incoming register stands for the first 32 message bits' worth of state.
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x0 = _mm_xor_si128(fold(x0, k64), load(p));
    x1 = _mm_xor_si128(fold(x1, k64), load(p + 16));
    x2 = _mm_xor_si128(fold(x2, k64), load(p + 32));
    x3 = _mm_xor_si128(fold(x3, k64), load(p + 48));
  }
  __m128i x = _mm_xor_si128(fold(x0, k16), x1);
  x = _mm_xor_si128(fold(x, k16), x2);
  x = _mm_xor_si128(fold(x, k16), x3);
  for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(fold(x, k16), load(p));
  // crc_raw(0, 16 bytes) is exactly "those 16 bytes' polynomial times x^32 mod P".
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  return crc_raw_hw(static_cast<uint32_t>(c), p, n);
}

// The same folding 64 bytes to a register on AVX-512 cores with VPCLMULQDQ
// (Intel Ice Lake and later, AMD Zen 4): four 64-byte accumulators step 256
// bytes at a time (each 128-bit lane folds as above), then fold into one
// 64-byte register and its four lanes into one, and finish as crc_raw_clmul.
// 2-3x the crc32 instruction's 16 GB/s per core measured on Zen 4.
struct WideFoldKeys {
  uint64_t k256[2], k64[2];
  WideFoldKeys() {
    const auto key = [](size_t e) { return static_cast<uint64_t>(xpow_mod(e)) << 32; };
    k256[0] = key(8 * 256 + 64 - 1);
    k256[1] = key(8 * 256 - 1);
    k64[0] = key(8 * 64 + 64 - 1);
    k64[1] = key(8 * 64 - 1);
  }
};
const WideFoldKeys& wide_fold_keys() {
  static const WideFoldKeys keys;
  return keys;
}

constexpr size_t kWideMin = 1024;  // below it the 128-bit folding is as fast

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) inline __m512i fold512(__m512i x, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11));
}

__attribute__((target("avx512f"))) inline __m512i load512(const uint8_t* q) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(q));
}

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2"))) uint32_t crc_raw_vclmul(uint32_t crc,
                                                                                    const uint8_t* p, size_t n) {
  if (n < kWideMin) return crc_raw_clmul(crc, p, n);
  const WideFoldKeys& wk = wide_fold_keys();
  const __m512i k256 = _mm512_broadcast_i32x4(
      _mm_set_epi64x(static_cast<long long>(wk.k256[1]), static_cast<long long>(wk.k256[0])));
  const __m512i k64 = _mm512_broadcast_i32x4(
      _mm_set_epi64x(static_cast<long long>(wk.k64[1]), static_cast<long long>(wk.k64[0])));
  __m512i x0 = _mm512_xor_si512(load512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  __m512i x1 = load512(p + 64), x2 = load512(p + 128), x3 = load512(p + 192);
  p += 256;
  n -= 256;
  for (; n >= 256; p += 256, n -= 256) {
    x0 = _mm512_xor_si512(fold512(x0, k256), load512(p));
    x1 = _mm512_xor_si512(fold512(x1, k256), load512(p + 64));
    x2 = _mm512_xor_si512(fold512(x2, k256), load512(p + 128));
    x3 = _mm512_xor_si512(fold512(x3, k256), load512(p + 192));
  }
  __m512i x = _mm512_xor_si512(fold512(x0, k64), x1);
  x = _mm512_xor_si512(fold512(x, k64), x2);
  x = _mm512_xor_si512(fold512(x, k64), x3);
  for (; n >= 64; p += 64, n -= 64) x = _mm512_xor_si512(fold512(x, k64), load512(p));
  // Four 16-byte lanes, first to last, into one (as crc_raw_clmul ends).
  const FoldKeys& fk = fold_keys();
  const __m128i k16 = _mm_set_epi64x(static_cast<long long>(fk.k16[1]), static_cast<long long>(fk.k16[0]));
  __m128i y = _mm512_extracti32x4_epi32(x, 0);
  y = _mm_xor_si128(fold(y, k16), _mm512_extracti32x4_epi32(x, 1));
  y = _mm_xor_si128(fold(y, k16), _mm512_extracti32x4_epi32(x, 2));
  y = _mm_xor_si128(fold(y, k16), _mm512_extracti32x4_epi32(x, 3));
  for (; n >= 16; p += 16, n -= 16)
    y = _mm_xor_si128(fold(y, k16), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(y)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(y, 1)));
  return crc_raw_hw(static_cast<uint32_t>(c), p, n);
}

bool have_vclmul() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("vpclmulqdq") != 0 &&
           __builtin_cpu_supports("pclmul") != 0 && __builtin_cpu_supports("sse4.2") != 0;
  }();
  return ok;
}

bool have_clmul() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") != 0 && __builtin_cpu_supports("sse4.2") != 0;
  }();
  return ok;
}

// Which of the two is faster depends on the core (folding: 1.5x on AMD Zen 1;
// the 3-lane crc32 path is at least as fast where crc32 issues every cycle,
// as on recent Intel cores), so the first CRC of the process times both on
// 256 KiB (best of 5, about a millisecond) and keeps the faster.
bool clmul_is_faster() {
  static const bool faster = [] {
    if (!have_clmul()) return false;
    std::vector<uint8_t> buf(256 << 10);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131u + (i >> 9));
    auto best = [&](uint32_t (*f)(uint32_t, const uint8_t*, size_t)) {
      double t = 1e9;
      volatile uint32_t sink = 0;
      for (int r = 0; r < 5; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        sink = sink + f(~0u, buf.data(), buf.size());
        t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      return t;
    };
    return best(crc_raw_clmul) < best(crc_raw_hw);
  }();
  return faster;
}
#endif

uint32_t crc_raw(uint32_t crc, const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  if (n >= kWideMin && have_vclmul()) return crc_raw_vclmul(crc, p, n);
  if (n >= kClmulMin && clmul_is_faster()) return crc_raw_clmul(crc, p, n);
  if (have_sse42()) return crc_raw_hw(crc, p, n);
#endif
  return crc_raw_soft(crc, p, n);
}

const char* crc_implementation() {
#if defined(__x86_64__)
  if (have_vclmul()) return "vpclmul";
  if (clmul_is_faster()) return "clmul";
  if (have_sse42()) return "crc32";
#endif
  return "table";
}

uint32_t crc32c_impl(uintptr_t ptr, size_t n, uint32_t seed) {
  return ~crc_raw(~seed, reinterpret_cast<const uint8_t*>(ptr), n);
}

// -------------------------------------------------------------- PageTable --
struct Layer : kvoffload::PageLayout {
  bool dense = false;  // one run covering the whole stride at offset 0
};

struct Copy {
  uint8_t* dst;
  const uint8_t* src;
  size_t len;
};

// Streaming (non-temporal) stores for big transfers.  A gather or scatter
// of megabytes is many memcpys of one segment each (tens of KiB), each below
// the size where glibc's memcpy switches to non-temporal stores itself, so
// each destination line is first read into cache (read-for-ownership) and
// later evicted: ~40% slower than one memcpy of the same bytes.  The
// destination is not read again soon (the I/O thread's CRC, a later attention
// step), so it goes straight to memory.  x86-64 only; elsewhere memcpy.
constexpr size_t kStreamMin = size_t(1) << 20;  // total bytes of one call
constexpr size_t kStreamSeg = 4096;             // bytes of one copy

#if defined(__x86_64__)
__attribute__((target("avx2"))) void stream_copy_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  if (head) {
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
  }
  for (; n >= 128; n -= 128, d += 128, s += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
  }
  if (n) std::memcpy(d, s, n);
}

bool have_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return ok;
}
#endif

// Copies [lo, hi) of every copy in `copies` (byte offsets into their concatenation).
void copy_range(const std::vector<Copy>& copies, size_t lo, size_t hi, bool stream) {
  size_t pos = 0;
  for (const Copy& c : copies) {
    const size_t a = std::max(lo, pos), b = std::min(hi, pos + c.len);
    if (a < b) {
#if defined(__x86_64__)
      if (stream && b - a >= kStreamSeg)
        stream_copy_avx2(c.dst + (a - pos), c.src + (a - pos), b - a);
      else
#endif
        std::memcpy(c.dst + (a - pos), c.src + (a - pos), b - a);
    }
    pos += c.len;
    if (pos >= hi) break;
  }
#if defined(__x86_64__)
  if (stream) _mm_sfence();  // order the streaming stores before we report done
#endif
}

// One thread saturates neither DRAM bandwidth nor (with fresh destination
// pages) the page-fault path, so big transfers are split by bytes across
// threads.  Small ones stay on the calling thread: spawning costs ~20us.
constexpr size_t kParallelMin = size_t(16) << 20;

void run_copies(const std::vector<Copy>& copies, int num_threads, bool allow_stream = true) {
  size_t total = 0;
  for (const Copy& c : copies) total += c.len;
  bool stream = false;
#if defined(__x86_64__)
  stream = allow_stream && total >= kStreamMin && have_avx2();
#endif
  const size_t nt = std::max<size_t>(
      1, std::min<size_t>(static_cast<size_t>(std::max(num_threads, 1)), total / (kParallelMin / 4)));
  if (nt == 1 || total < kParallelMin) {
    copy_range(copies, 0, total, stream);
    return;
  }
  // Thread k copies bytes [k*total/nt, (k+1)*total/nt) of the concatenated list.
  auto work = [&](size_t k) { copy_range(copies, k * total / nt, (k + 1) * total / nt, stream); };
  std::vector<std::thread> threads;
  threads.reserve(nt - 1);
  for (size_t k = 1; k < nt; ++k) threads.emplace_back(work, k);
  work(0);
  for (auto& t : threads) t.join();
}

// Copy `n` bytes and fold them into the raw CRC register `raw` in one pass: each piece is
// CRC'd from cache right after it is copied, instead of a second pass that reads it back from
// memory. Large copies stream their stores (see stream_copy_avx2); the caller issues the
// store fence (`copy_crc_fence`) once after its last piece.
constexpr size_t kFusedPiece = size_t(16) << 10;

uint32_t copy_crc_raw(uint8_t* dst, const uint8_t* src, size_t n, uint32_t raw, bool stream,
                      kvoffload::GhashState* gh = nullptr, bool with_crc = true) {
  for (size_t off = 0; off < n; off += kFusedPiece) {
    const size_t k = std::min(kFusedPiece, n - off);
#if defined(__x86_64__)
    if (stream && k >= kStreamSeg)
      stream_copy_avx2(dst + off, src + off, k);
    else
#endif
      std::memcpy(dst + off, src + off, k);
    if (with_crc) raw = crc_raw(raw, src + off, k);  // the piece just read: from L1/L2
    if (gh != nullptr) kvoffload::ghash_update(*gh, src + off, k);
  }
  return raw;
}

// The CRC register and, with `gh`, the GHASH of `n` bytes in one pass, piece by piece from cache.
uint32_t crc_ghash_raw(const uint8_t* p, size_t n, uint32_t raw, kvoffload::GhashState& gh) {
  for (size_t off = 0; off < n; off += kFusedPiece) {
    const size_t k = std::min(kFusedPiece, n - off);
    raw = crc_raw(raw, p + off, k);
    kvoffload::ghash_update(gh, p + off, k);
  }
  return raw;
}

bool copy_crc_streams(size_t total) {
#if defined(__x86_64__)
  return total >= kStreamMin && have_avx2();
#else
  (void)total;
  return false;
#endif
}

void copy_crc_fence(bool stream) {
#if defined(__x86_64__)
  if (stream) _mm_sfence();
#else
  (void)stream;
#endif
}

class PageTable {
 public:
  using LayerSpec = kvoffload::LayerSpec;

  PageTable(const std::vector<LayerSpec>& specs, int num_threads) : num_threads_(num_threads) {
    if (specs.empty()) throw py::value_error("PageTable needs at least one layer");
    if (num_threads < 1) throw py::value_error("num_threads must be >= 1");
    for (const auto& s : specs) {
      Layer L{kvoffload::parse_layer_spec(s)};
      L.dense = L.runs.size() == 1 && L.runs[0].first == 0 && L.runs[0].second == L.block_stride;
      page_bytes_ += L.page_bytes;
      layers_.push_back(std::move(L));
    }
  }

  int64_t page_bytes() const { return page_bytes_; }
  size_t num_layers() const { return layers_.size(); }
  int num_threads() const { return num_threads_; }

  void gather(const std::vector<int64_t>& ids, uint64_t dst_ptr, int64_t dst_bytes) const {
    kvoffload::check_gather_args(ids, dst_bytes, page_bytes_);
    py::gil_scoped_release nogil;
    run_copies(gather_copies(ids, dst_ptr), num_threads_);
  }

  // The gather, and the CRC-32C (seeded as crc32c's `seed`) of the whole destination, taken in the
  // same pass: the copies fill it front to back, each 16 KiB piece CRC'd from cache right after it
  // is copied (one thread: the order is the CRC's).
  // With `gh`, the destination is hashed into it (a MAC's GHASH) in the same pass.
  uint32_t gather_crc(const std::vector<int64_t>& ids, uint64_t dst_ptr, int64_t dst_bytes, uint32_t seed,
                      kvoffload::GhashState* gh) const {
    kvoffload::check_gather_args(ids, dst_bytes, page_bytes_);
    py::gil_scoped_release nogil;
    const bool stream = copy_crc_streams(static_cast<size_t>(dst_bytes));
    uint32_t raw = ~seed;
    for (const Copy& c : gather_copies(ids, dst_ptr)) raw = copy_crc_raw(c.dst, c.src, c.len, raw, stream, gh);
    copy_crc_fence(stream);
    return ~raw;
  }

 private:
  // The copies of a gather into `dst_ptr`, in destination order (layer-major, then block).
  std::vector<Copy> gather_copies(const std::vector<int64_t>& ids, uint64_t dst_ptr) const {
    std::vector<Copy> copies;
    auto* dst = reinterpret_cast<uint8_t*>(dst_ptr);
    for (const Layer& L : layers_) {
      const size_t n = ids.size();
      for (size_t i = 0; i < n;) {
        // Dense layers: a run of consecutive block ids is one contiguous range
        // on both sides (dst is layer-major), so it is one copy.
        size_t j = i + 1;
        if (L.dense)
          while (j < n && ids[j] == ids[j - 1] + 1) ++j;
        const uint8_t* blk = reinterpret_cast<const uint8_t*>(L.base + ids[i] * L.block_stride);
        if (L.dense) {
          const size_t len = (j - i) * static_cast<size_t>(L.page_bytes);
          copies.push_back({dst, blk, len});
          dst += len;
        } else {
          for (const auto& r : L.runs) {
            copies.push_back({dst, blk + r.first, static_cast<size_t>(r.second)});
            dst += r.second;
          }
        }
        i = j;
      }
    }
    return copies;
  }

 public:
  void scatter(uint64_t src_ptr, int64_t src_bytes, int64_t n_src,
               const std::vector<std::pair<int64_t, int64_t>>& pairs) const {
    kvoffload::check_scatter_args(src_bytes, n_src, pairs, page_bytes_);
    py::gil_scoped_release nogil;
    run_scatter(src_ptr, n_src, pairs, nullptr, 0);
  }

  // The scatter, and the CRC-32C (seeded as crc32c's `seed`) of the whole source buffer. Where the
  // copies read the buffer front to back with no gap (every page once, in order: a whole chunk's
  // load), the CRC is taken in the same pass, piece by piece from cache right after each piece is
  // copied; otherwise the buffer is CRC'd first and then scattered.
  uint32_t scatter_crc(uint64_t src_ptr, int64_t src_bytes, int64_t n_src,
                       const std::vector<std::pair<int64_t, int64_t>>& pairs, uint32_t seed) const {
    kvoffload::check_scatter_args(src_bytes, n_src, pairs, page_bytes_);
    py::gil_scoped_release nogil;
    uint32_t raw = ~seed;
    run_scatter(src_ptr, n_src, pairs, &raw, static_cast<size_t>(src_bytes));
    return ~raw;
  }

  // The scatter, with the whole source buffer hashed into `gh` (GHASH, for the MAC) in the same
  // pass under the same condition as scatter_crc's CRC.
  void scatter_ghash(uint64_t src_ptr, int64_t src_bytes, int64_t n_src,
                     const std::vector<std::pair<int64_t, int64_t>>& pairs, kvoffload::GhashState& gh) const {
    kvoffload::check_scatter_args(src_bytes, n_src, pairs, page_bytes_);
    py::gil_scoped_release nogil;
    run_scatter(src_ptr, n_src, pairs, nullptr, static_cast<size_t>(src_bytes), &gh);
  }

 private:
  // `crc` non-null: the raw CRC register over the `src_bytes` of the source, updated (see scatter_crc);
  // `gh` non-null: the source's bytes are hashed into it too (see scatter_ghash).
  void run_scatter(uint64_t src_ptr, int64_t n_src, const std::vector<std::pair<int64_t, int64_t>>& pairs,
                   uint32_t* crc, size_t src_bytes, kvoffload::GhashState* gh = nullptr) const {
    std::vector<Copy> copies;
    const auto* src = reinterpret_cast<const uint8_t*>(src_ptr);
    for (const Layer& L : layers_) {
      const size_t n = pairs.size();
      for (size_t i = 0; i < n;) {
        size_t j = i + 1;
        if (L.dense)
          while (j < n && pairs[j].first == pairs[j - 1].first + 1 &&
                 pairs[j].second == pairs[j - 1].second + 1)
            ++j;
        const uint8_t* s = src + pairs[i].first * L.page_bytes;
        uint8_t* blk = reinterpret_cast<uint8_t*>(L.base + pairs[i].second * L.block_stride);
        if (L.dense) {
          copies.push_back({blk, s, (j - i) * static_cast<size_t>(L.page_bytes)});
        } else {
          for (const auto& r : L.runs) {
            copies.push_back({blk + r.first, s, static_cast<size_t>(r.second)});
            s += r.second;
          }
        }
        i = j;
      }
      src += n_src * L.page_bytes;
    }
    // Duplicate destinations must resolve as "last pair wins", which a
    // parallel split would not guarantee; they are rare, so go serial then.
    bool dup = false;
    if (num_threads_ > 1) {
      std::vector<int64_t> dsts;
      dsts.reserve(pairs.size());
      for (const auto& pr : pairs) dsts.push_back(pr.second);
      std::sort(dsts.begin(), dsts.end());
      dup = std::adjacent_find(dsts.begin(), dsts.end()) != dsts.end();
    }
    if (crc == nullptr && gh == nullptr) {
      run_copies(copies, dup ? 1 : num_threads_);
      return;
    }
    const auto* base = reinterpret_cast<const uint8_t*>(src_ptr);
    const uint8_t* next = base;
    for (const Copy& c : copies) {
      if (c.src != next) break;
      next += c.len;
    }
    if (next != base + src_bytes || dup) {
      if (crc != nullptr) *crc = crc_raw(*crc, base, src_bytes);
      if (gh != nullptr) kvoffload::ghash_update(*gh, base, src_bytes);
      run_copies(copies, dup ? 1 : num_threads_);
      return;
    }
    const bool stream = copy_crc_streams(src_bytes);
    uint32_t raw = crc != nullptr ? *crc : 0u;
    for (const Copy& c : copies) raw = copy_crc_raw(c.dst, c.src, c.len, raw, stream, gh, crc != nullptr);
    if (crc != nullptr) *crc = raw;
    copy_crc_fence(stream);
  }

  std::vector<Layer> layers_;
  int64_t page_bytes_ = 0;
  int num_threads_ = 1;
};

// ---------------------------------------------------------------- file IO --
// Errors are collected as (errno, path) while the GIL is released and turned
// into OSError (with .errno/.filename, and the right subclass such as
// FileNotFoundError) once it is held again.
struct IoError {
  int err = 0;
  std::string path;
  std::string value_error;  // non-empty: raise ValueError instead of OSError
  bool set(int e, const std::string& p) {
    err = e;
    path = p;
    return false;
  }
};

[[noreturn]] void raise_io(const IoError& e) {
  if (!e.value_error.empty()) throw py::value_error(e.value_error);
  errno = e.err;
  PyErr_SetFromErrnoWithFilename(PyExc_OSError, e.path.c_str());
  throw py::error_already_set();
}

constexpr size_t kMaxIo = size_t(1) << 30;  // Linux caps a single read/write near 2 GiB

bool write_all(int fd, const uint8_t* p, size_t n, IoError& e, const std::string& path) {
  while (n) {
    ssize_t w = ::write(fd, p, std::min(n, kMaxIo));
    if (w < 0) {
      if (errno == EINTR) continue;
      return e.set(errno, path);
    }
    if (w == 0) return e.set(EIO, path);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes; a short file (EOF first) is reported as EIO, since
// the caller already checked the size and the file changed under us.
bool read_all(int fd, uint8_t* p, size_t n, IoError& e, const std::string& path) {
  while (n) {
    ssize_t r = ::read(fd, p, std::min(n, kMaxIo));
    if (r < 0) {
      if (errno == EINTR) continue;
      return e.set(errno, path);
    }
    if (r == 0) return e.set(EIO, path);
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

std::string dir_of(const std::string& path) {
  auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

// The end of every file write: optional fdatasync, close, rename of the
// temporary file into place, optional fsync of the directory. Takes `fd`;
// on failure before the rename the temporary file is removed.
bool publish(int fd, const std::string& tmp, const std::string& fin, bool do_fsync, IoError& e) {
  if (do_fsync && ::fdatasync(fd) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return e.set(err, tmp);
  }
  if (::close(fd) != 0) {  // close can report deferred write errors (NFS, quota)
    int err = errno;
    ::unlink(tmp.c_str());
    return e.set(err, tmp);
  }
  if (::rename(tmp.c_str(), fin.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return e.set(err, fin);
  }
  if (do_fsync) {
    // Persist the rename itself; the file is already in place, so only report.
    const std::string dir = dir_of(fin);
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return e.set(errno, dir);
    if (::fsync(dfd) != 0 && errno != EINVAL) {  // EINVAL: fs without dir fsync
      int err = errno;
      ::close(dfd);
      return e.set(err, dir);
    }
    ::close(dfd);
  }
  return true;
}

bool write_file_impl(const std::string& tmp, const std::string& fin, const std::string& header,
                     uintptr_t payload, size_t payload_len, bool do_fsync, int mode,
                     IoError& e) {
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  // On EEXIST the tmp file belongs to someone else: never unlink it.
  if (fd < 0) return e.set(errno, tmp);
  auto fail = [&](int err, const std::string& p) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return e.set(err, p);
  };
  if (!write_all(fd, reinterpret_cast<const uint8_t*>(header.data()), header.size(), e, tmp))
    return fail(e.err, e.path);
  if (!write_all(fd, reinterpret_cast<const uint8_t*>(payload), payload_len, e, tmp))
    return fail(e.err, e.path);
  return publish(fd, tmp, fin, do_fsync, e);
}

void write_file(const std::string& tmp, const std::string& fin, const py::bytes& header_obj,
                uint64_t payload_ptr, int64_t payload_len, bool do_fsync, int mode) {
  if (payload_len < 0) throw py::value_error("payload_len must be >= 0");
  std::string header = header_obj;
  IoError e;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = write_file_impl(tmp, fin, header, payload_ptr, static_cast<size_t>(payload_len),
                         do_fsync, mode, e);
  }
  if (!ok) raise_io(e);
}

// `with_crc` false: no CRC (crc is left 0), for readers that verify a MAC
// instead and compute the CRC only when the MAC fails (to tell damage from forgery).
bool read_file_impl(const std::string& path, size_t header_len, uintptr_t payload,
                    size_t payload_len, std::string& header, uint32_t& crc, IoError& e,
                    bool with_crc = true) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return e.set(errno, path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return e.set(err, path);
  }
  const uint64_t want = static_cast<uint64_t>(header_len) + payload_len;
  if (static_cast<uint64_t>(st.st_size) != want) {
    ::close(fd);
    e.value_error = "file " + path + " has size " + std::to_string(st.st_size) +
                    " but expected " + std::to_string(want) + " (header " +
                    std::to_string(header_len) + " + payload " + std::to_string(payload_len) +
                    ")";
    return false;
  }
#ifdef POSIX_FADV_SEQUENTIAL
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
  header.resize(header_len);
  if (!read_all(fd, reinterpret_cast<uint8_t*>(&header[0]), header_len, e, path)) {
    ::close(fd);
    return false;
  }
  // CRC each chunk right after reading it, while it is still in cache.
  constexpr size_t kChunk = size_t(1) << 20;
  auto* p = reinterpret_cast<uint8_t*>(payload);
  uint32_t raw = ~0u;
  for (size_t left = payload_len; left;) {
    const size_t n = std::min(left, kChunk);
    if (!read_all(fd, p, n, e, path)) {
      ::close(fd);
      return false;
    }
    if (with_crc) raw = crc_raw(raw, p, n);
    p += n;
    left -= n;
  }
  crc = with_crc ? ~raw : 0u;
  ::close(fd);
  return true;
}

// O_DIRECT store of a file whose bytes (header + payload) already sit in one
// buffer: `buf_ptr` holds `file_len` bytes and is readable up to `buf_len`, a
// multiple of kDirectAlign >= file_len.  The aligned part of `file_len` is
// written with O_DIRECT (no page-cache copy, no writeback later) and the last
// partial block buffered, through the same descriptor with O_DIRECT cleared:
// writing the whole aligned length and truncating it back cost ext4 a second
// journalled extent change per file, which held back parallel stores.
// Falls back to a buffered write of `file_len` bytes when the buffer is not
// aligned or the filesystem refuses O_DIRECT (tmpfs, some overlay/NFS mounts).
// Returns whether O_DIRECT was used.
constexpr size_t kDirectAlign = 4096;

bool write_file_direct_impl(const std::string& tmp, const std::string& fin, uintptr_t buf,
                            size_t file_len, size_t buf_len, bool do_fsync, int mode,
                            bool& used_direct, IoError& e) {
  used_direct = false;
  const bool aligned = (buf % kDirectAlign) == 0 && (buf_len % kDirectAlign) == 0 &&
                       buf_len >= file_len && buf_len - file_len < kDirectAlign;
  int fd = -1;
#ifdef O_DIRECT
  if (aligned) {
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, mode);
    if (fd >= 0) {
      used_direct = true;
    } else if (errno != EINVAL) {
      return e.set(errno, tmp);  // EEXIST etc.: the tmp file is not ours
    }
  }
#endif
  if (fd < 0) {
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0) return e.set(errno, tmp);
  }
  auto fail = [&](int err, const std::string& p) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    return e.set(err, p);
  };
  const auto* p = reinterpret_cast<const uint8_t*>(buf);
  if (used_direct) {
    const size_t head = file_len / kDirectAlign * kDirectAlign;
    bool ok = write_all(fd, p, head, e, tmp);
    if (ok && head != file_len) {
      // The partial last block through a second, buffered descriptor. Clearing O_DIRECT on this
      // one with fcntl is not enough everywhere: GlusterFS keeps O_DIRECT for the open file on
      // its bricks and fails the close (EINVAL) once the unaligned tail is flushed.
      const int closed = ::close(fd);
      fd = -1;
      if (closed != 0) {
        ok = e.set(errno, tmp);
      } else if ((fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC)) < 0 ||
                 ::lseek(fd, static_cast<off_t>(head), SEEK_SET) < 0) {
        ok = e.set(errno, tmp);
      } else {
        ok = write_all(fd, p + head, file_len - head, e, tmp);
      }
    }
    if (!ok && e.err == EINVAL) {
      // Accepted at open, refused at a write or its close (some FUSE/NFS): redo buffered.
      if (fd >= 0) ::close(fd);
      ::unlink(tmp.c_str());
      used_direct = false;
      fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
      if (fd < 0) return e.set(errno, tmp);
      if (!write_all(fd, p, file_len, e, tmp)) return fail(e.err, e.path);
    } else if (!ok) {
      return fail(e.err, e.path);
    }
  } else if (!write_all(fd, p, file_len, e, tmp)) {
    return fail(e.err, e.path);
  }
  return publish(fd, tmp, fin, do_fsync, e);
}

bool write_file_direct(const std::string& tmp, const std::string& fin, uint64_t buf_ptr,
                       int64_t file_len, int64_t buf_len, bool do_fsync, int mode) {
  if (file_len < 0 || buf_len < file_len) throw py::value_error("need 0 <= file_len <= buf_len");
  IoError e;
  bool ok, used_direct = false;
  {
    py::gil_scoped_release nogil;
    ok = write_file_direct_impl(tmp, fin, buf_ptr, static_cast<size_t>(file_len),
                                static_cast<size_t>(buf_len), do_fsync, mode, used_direct, e);
  }
  if (!ok) raise_io(e);
  return used_direct;
}

// O_DIRECT load of a whole file (header + payload, `header_len + payload_len`
// bytes) into one buffer at `buf` of `buf_cap` bytes, the file's length
// rounded up to kDirectAlign or more: the device writes straight into the
// buffer, with no page-cache copy (which costs a buffered load more CPU than
// its checksum and its scatter together). The payload's CRC is computed after
// the read. Falls back to a buffered read of the same bytes when the buffer
// is not aligned or the filesystem refuses O_DIRECT (EINVAL at open or at a
// read). Returns whether O_DIRECT was used.
bool read_file_direct_impl(const std::string& path, size_t header_len, uintptr_t buf, size_t buf_cap,
                           size_t payload_len, std::string& header, uint32_t& crc, bool& used_direct,
                           IoError& e, bool with_crc = true) {
  used_direct = false;
  const size_t want = header_len + payload_len;
  const size_t aligned_len = (want + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  const bool aligned = (buf % kDirectAlign) == 0 && buf_cap >= aligned_len;
  auto* p = reinterpret_cast<uint8_t*>(buf);
  int fd = -1;
#ifdef O_DIRECT
  if (aligned) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd >= 0) {
      used_direct = true;
    } else if (errno != EINVAL) {
      return e.set(errno, path);
    }
  }
#endif
  if (fd < 0) {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return e.set(errno, path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return e.set(err, path);
  }
  if (static_cast<uint64_t>(st.st_size) != want) {
    ::close(fd);
    e.value_error = "file " + path + " has size " + std::to_string(st.st_size) + " but expected " +
                    std::to_string(want) + " (header " + std::to_string(header_len) + " + payload " +
                    std::to_string(payload_len) + ")";
    return false;
  }
  if (used_direct) {
    // Whole aligned lengths from aligned offsets; only the read reaching EOF is short.
    size_t got = 0;
    bool refused = false;
    while (got < want) {
      ssize_t r = ::read(fd, p + got, std::min(aligned_len - got, kMaxIo));
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EINVAL) {  // accepted at open, refused at read (some FUSE/NFS): redo buffered
          refused = true;
          break;
        }
        int err = errno;
        ::close(fd);
        return e.set(err, path);
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    if (refused) {
      ::close(fd);
      used_direct = false;
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return e.set(errno, path);
    } else if (got < want) {  // the file shrank after the size check
      ::close(fd);
      return e.set(EIO, path);
    }
  }
  if (!used_direct) {
#ifdef POSIX_FADV_SEQUENTIAL
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
#endif
    if (!read_all(fd, p, want, e, path)) {
      ::close(fd);
      return false;
    }
  }
  ::close(fd);
  header.assign(reinterpret_cast<const char*>(p), header_len);
  crc = with_crc ? ~crc_raw(~0u, p + header_len, payload_len) : 0u;
  return true;
}

py::tuple read_file_direct(const std::string& path, int64_t header_len, uint64_t buf_ptr, int64_t buf_cap,
                           int64_t payload_len, bool with_crc) {
  if (header_len < 0 || payload_len < 0) throw py::value_error("lengths must be >= 0");
  if (buf_cap < header_len + payload_len) throw py::value_error("buf_cap must hold header_len + payload_len");
  std::string header;
  uint32_t crc = 0;
  bool used_direct = false;
  IoError e;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = read_file_direct_impl(path, static_cast<size_t>(header_len), buf_ptr, static_cast<size_t>(buf_cap),
                               static_cast<size_t>(payload_len), header, crc, used_direct, e, with_crc);
  }
  if (!ok) raise_io(e);
  return py::make_tuple(py::bytes(header), crc, used_direct);
}

py::tuple read_file(const std::string& path, int64_t header_len, uint64_t payload_ptr,
                    int64_t payload_len, bool with_crc) {
  if (header_len < 0 || payload_len < 0) throw py::value_error("lengths must be >= 0");
  std::string header;
  uint32_t crc = 0;
  IoError e;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = read_file_impl(path, static_cast<size_t>(header_len), payload_ptr,
                        static_cast<size_t>(payload_len), header, crc, e, with_crc);
  }
  if (!ok) raise_io(e);
  return py::make_tuple(py::bytes(header), crc);
}

py::bytes read_header(const std::string& path, int64_t header_len) {
  if (header_len < 0) throw py::value_error("header_len must be >= 0");
  std::string header;
  IoError e;
  bool ok = false;
  {
    py::gil_scoped_release nogil;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      e.set(errno, path);
    } else {
      struct stat st;
      if (::fstat(fd, &st) != 0) {
        e.set(errno, path);
      } else if (static_cast<uint64_t>(st.st_size) < static_cast<uint64_t>(header_len)) {
        e.value_error = "file " + path + " has size " + std::to_string(st.st_size) +
                        ", shorter than header_len " + std::to_string(header_len);
      } else {
        header.resize(static_cast<size_t>(header_len));
        ok = read_all(fd, reinterpret_cast<uint8_t*>(&header[0]), header.size(), e, path);
      }
      ::close(fd);
    }
  }
  if (!ok) raise_io(e);
  return py::bytes(header);
}

uint32_t check_seed(int64_t seed) {
  if (seed < 0 || seed > 0xFFFFFFFFll) throw py::value_error("seed must be a uint32");
  return static_cast<uint32_t>(seed);
}

}  // namespace

PYBIND11_MODULE(_copier, m) {
  m.doc() = "CPU byte movers for kvoffload: CRC-32C, paged gather/scatter, file IO";

  m.def(
      "crc32c",
      [](uint64_t ptr, int64_t nbytes, int64_t seed) {
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        uint32_t s = check_seed(seed);
        py::gil_scoped_release nogil;
        return crc32c_impl(ptr, static_cast<size_t>(nbytes), s);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0,
      "CRC-32C of nbytes at ptr; seed continues a previous CRC.");
  m.def(
      "crc32c_software",
      [](uint64_t ptr, int64_t nbytes, int64_t seed) {
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        uint32_t s = check_seed(seed);
        py::gil_scoped_release nogil;
        return ~crc_raw_soft(~s, reinterpret_cast<const uint8_t*>(ptr),
                             static_cast<size_t>(nbytes));
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed") = 0,
      "CRC-32C via the table path only (for testing).");
  m.def(
      "crc32c_variant",
      [](uint64_t ptr, int64_t nbytes, int64_t seed, const std::string& variant) {
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        uint32_t s = check_seed(seed);
        const auto* p = reinterpret_cast<const uint8_t*>(ptr);
        const size_t n = static_cast<size_t>(nbytes);
        if (variant == "table") {
          py::gil_scoped_release nogil;
          return ~crc_raw_soft(~s, p, n);
        }
#if defined(__x86_64__)
        if (variant == "crc32" && have_sse42()) {
          py::gil_scoped_release nogil;
          return ~crc_raw_hw(~s, p, n);
        }
        if (variant == "clmul" && have_clmul()) {
          py::gil_scoped_release nogil;
          return ~crc_raw_clmul(~s, p, n);
        }
        if (variant == "vpclmul" && have_vclmul()) {
          py::gil_scoped_release nogil;
          return ~crc_raw_vclmul(~s, p, n);
        }
#endif
        throw py::value_error("crc32c variant " + variant + " is not available on this CPU");
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("seed"), py::arg("variant"),
      "CRC-32C by one named implementation: 'table' (slice-by-8), 'crc32' (SSE4.2 instruction, "
      "3 lanes), 'clmul' (PCLMULQDQ folding), 'vpclmul' (AVX-512 VPCLMULQDQ folding, what crc32c() uses "
      "where the CPU has it); for tests and benchmarks.");
  m.def(
      "crc32c_buffer",
      [](py::buffer buf, int64_t seed) {
        uint32_t s = check_seed(seed);
        Py_buffer view;  // PyBUF_SIMPLE: C-contiguous bytes or a BufferError
        if (PyObject_GetBuffer(buf.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
        uint32_t crc;
        {
          py::gil_scoped_release nogil;
          crc = crc32c_impl(reinterpret_cast<uintptr_t>(view.buf), static_cast<size_t>(view.len), s);
        }
        PyBuffer_Release(&view);
        return crc;
      },
      py::arg("buf"), py::arg("seed") = 0,
      "CRC-32C of any contiguous buffer-protocol object (bytes, bytearray, memoryview).");
  m.def(
      "crc32c_hardware_available",
      []() {
#if defined(__x86_64__)
        return have_sse42();
#else
        return false;
#endif
      },
      "True when crc32c() uses the SSE4.2 instruction (directly or to finish a PCLMULQDQ fold).");
  m.def("crc32c_implementation", []() { return std::string(crc_implementation()); },
        "The CRC-32C path crc32c() takes on this CPU: 'clmul', 'crc32' or 'table'.");

  py::class_<PageTable>(m, "PageTable")
      .def(py::init<const std::vector<PageTable::LayerSpec>&, int>(), py::arg("layers"),
           py::arg("num_threads") = 1)
      .def_property_readonly("page_bytes", &PageTable::page_bytes)
      .def_property_readonly("num_layers", &PageTable::num_layers)
      .def_property_readonly("num_threads", &PageTable::num_threads)
      .def("gather", &PageTable::gather, py::arg("block_ids"), py::arg("dst_ptr"),
           py::arg("dst_bytes"))
      .def("gather_crc", &PageTable::gather_crc, py::arg("block_ids"), py::arg("dst_ptr"), py::arg("dst_bytes"),
           py::arg("seed") = 0, py::arg("ghash") = nullptr,
           "gather, returning the CRC-32C of the destination (computed in the copy's pass) and hashing it "
           "into `ghash` (None: no hash) in the same pass")
      .def("scatter", &PageTable::scatter, py::arg("src_ptr"), py::arg("src_bytes"),
           py::arg("n_src_blocks"), py::arg("pairs"))
      .def("scatter_crc", &PageTable::scatter_crc, py::arg("src_ptr"), py::arg("src_bytes"),
           py::arg("n_src_blocks"), py::arg("pairs"), py::arg("seed") = 0,
           "scatter, returning the CRC-32C of the whole source buffer (computed in the copy's pass "
           "where the copies read it front to back)")
      .def("scatter_ghash", &PageTable::scatter_ghash, py::arg("src_ptr"), py::arg("src_bytes"),
           py::arg("n_src_blocks"), py::arg("pairs"), py::arg("ghash"),
           "scatter, hashing the whole source buffer into `ghash` in the copy's pass (as scatter_crc)");

  m.def("ghash_supported", []() { return kvoffload::ghash_have_clmul(); },
        "True where Ghash runs at all (x86-64 with PCLMULQDQ).");
  m.def("ghash_wide", []() { return kvoffload::ghash_have_wide(); },
        "True where Ghash takes its AVX-512 VPCLMULQDQ path (the speed of cryptography's GMAC or more).");
  py::class_<kvoffload::GhashState>(m, "Ghash",
                                    "GCM's GHASH under a hash key H, everything hashed as associated data")
      .def(py::init([](py::bytes h, bool wide) {
             std::string k = h;
             if (k.size() != 16) throw py::value_error("the GHASH key H must be 16 bytes");
             if (!kvoffload::ghash_have_clmul()) throw py::value_error("GHASH needs x86-64 with PCLMULQDQ");
             auto* st = new kvoffload::GhashState();
             kvoffload::ghash_init(*st, reinterpret_cast<const uint8_t*>(k.data()));
             st->wide = st->wide && wide;
             return st;
           }),
           py::arg("h"), py::arg("wide") = true, "`wide` False: the PCLMULQDQ path even where AVX-512 runs (tests)")
      .def(
          "update",
          [](kvoffload::GhashState& st, uint64_t ptr, int64_t nbytes) {
            if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
            py::gil_scoped_release nogil;
            kvoffload::ghash_update(st, reinterpret_cast<const uint8_t*>(ptr), static_cast<size_t>(nbytes));
          },
          py::arg("ptr"), py::arg("nbytes"))
      .def(
          "update_buffer",
          [](kvoffload::GhashState& st, py::buffer buf) {
            Py_buffer view;
            if (PyObject_GetBuffer(buf.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
            {
              py::gil_scoped_release nogil;
              kvoffload::ghash_update(st, static_cast<const uint8_t*>(view.buf), static_cast<size_t>(view.len));
            }
            PyBuffer_Release(&view);
          },
          py::arg("buf"))
      .def("digest",
           [](const kvoffload::GhashState& st) {
             uint8_t out[16];
             kvoffload::ghash_digest(st, out);
             return py::bytes(reinterpret_cast<const char*>(out), 16);
           })
      .def_property_readonly("nbytes", [](const kvoffload::GhashState& st) { return st.total; });
  m.def(
      "crc32c_ghash",
      [](uint64_t ptr, int64_t nbytes, kvoffload::GhashState& gh, int64_t seed) {
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        uint32_t s = check_seed(seed);
        py::gil_scoped_release nogil;
        return ~crc_ghash_raw(reinterpret_cast<const uint8_t*>(ptr), static_cast<size_t>(nbytes), ~s, gh);
      },
      py::arg("ptr"), py::arg("nbytes"), py::arg("ghash"), py::arg("seed") = 0,
      "CRC-32C of nbytes at ptr, hashing them into `ghash` in the same pass.");

  m.def("write_file", &write_file, py::arg("tmp_path"), py::arg("final_path"),
        py::arg("header"), py::arg("payload_ptr"), py::arg("payload_len"), py::arg("fsync"),
        py::arg("mode") = 0640);
  m.def("write_file_direct", &write_file_direct, py::arg("tmp_path"), py::arg("final_path"),
        py::arg("buf_ptr"), py::arg("file_len"), py::arg("buf_len"), py::arg("fsync"),
        py::arg("mode") = 0640,
        "Write file_len bytes at buf_ptr to tmp_path with O_DIRECT where possible, then rename; "
        "returns whether O_DIRECT was used.");
  m.def(
      "memcpy",
      [](uint64_t dst, uint64_t src, int64_t nbytes, int num_threads) {
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        py::gil_scoped_release nogil;
        run_copies({{reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(src),
                     static_cast<size_t>(nbytes)}},
                   num_threads, /*allow_stream=*/false);
      },
      py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("nbytes"), py::arg("num_threads") = 1,
      "Plain contiguous memcpy (glibc's, no streaming stores of ours), split across threads like "
      "PageTable copies (a benchmark baseline).");
  m.def(
      "copy_crc",
      [](uint64_t dst, uint64_t src, int64_t nbytes, int64_t seed, kvoffload::GhashState* gh) {
        if (nbytes < 0) throw py::value_error("nbytes must be >= 0");
        uint32_t s = check_seed(seed);
        py::gil_scoped_release nogil;
        const bool stream = copy_crc_streams(static_cast<size_t>(nbytes));
        const uint32_t raw = copy_crc_raw(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(src),
                                          static_cast<size_t>(nbytes), ~s, stream, gh);
        copy_crc_fence(stream);
        return ~raw;
      },
      py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("nbytes"), py::arg("seed") = 0, py::arg("ghash") = nullptr,
      "Copy nbytes from src to dst and return their CRC-32C (seeded), taken in the copy's pass; with "
      "`ghash`, hash them into it in the same pass.");
  m.def("read_file", &read_file, py::arg("path"), py::arg("header_len"),
        py::arg("payload_ptr"), py::arg("payload_len"), py::arg("with_crc") = true);
  m.def("read_file_direct", &read_file_direct, py::arg("path"), py::arg("header_len"), py::arg("buf_ptr"),
        py::arg("buf_cap"), py::arg("payload_len"), py::arg("with_crc") = true,
        "Read a whole file (header_len + payload_len bytes) into buf_ptr with O_DIRECT where possible; "
        "returns (header, crc32c(payload) or 0 without with_crc, O_DIRECT used).");
  m.def("read_header", &read_header, py::arg("path"), py::arg("header_len"));
}
