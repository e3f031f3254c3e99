// GHASH, GCM's polynomial hash over GF(2^128) (NIST SP 800-38D, section 6.4), so that the
// copier can feed the AES-256-GMAC of a chunk (MAC v2) in the same pass that moves or CRCs
// its bytes, instead of a second pass over memory.  Only the hash is here: the hash key
// H = AES_K(0^128) and the tag mask AES_K(J0) come from the AES of `cryptography`, and the
// tag is S xor AES_K(J0), exactly GCM's with everything as associated data (so tags are those
// cryptography computes; tests/test_ghash.py holds the two together).
//
// Values are kept byte-reversed, as in Intel's "Carry-Less Multiplication and its Usage for
// Computing the GCM Mode" (algorithm 5): a product is four carry-less multiplies, a shift left
// by one and a reduction modulo x^128 + x^7 + x^2 + x + 1.  The shift and the reduction are
// linear, so many products are summed first and reduced once (aggregation, with the powers
// H^1..H^32): 32 blocks per reduction with AVX-512 VPCLMULQDQ, 4 with PCLMULQDQ.  The MAC uses
// this hash only where the AVX-512 path runs (offload/copier.py ghash_available): the 128-bit
// one is slower than cryptography's own GMAC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvoffload {

constexpr int kGhashPowers = 32;
// How far ahead the AVX-512 loop prefetches: its multiplies leave the core too busy for the
// hardware prefetcher to keep a cold buffer streaming.
constexpr size_t kGhashAhead = 8192;

struct GhashState {
  alignas(64) uint8_t pow[kGhashPowers][16];  // pow[i] = H^(32 - i), byte-reversed
  uint8_t x[16] = {};                         // the running hash, byte-reversed
  uint8_t part[16] = {};                      // bytes of a block not yet complete
  size_t part_len = 0;
  uint64_t total = 0;                         // bytes hashed so far
  bool wide = false;                          // the VPCLMULQDQ path
};

#if defined(__x86_64__)

inline bool ghash_have_clmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("pclmul") != 0 && __builtin_cpu_supports("ssse3") != 0;
}

inline bool ghash_have_wide() {
  __builtin_cpu_init();
  return ghash_have_clmul() && __builtin_cpu_supports("avx512f") != 0 &&
         __builtin_cpu_supports("avx512bw") != 0 && __builtin_cpu_supports("vpclmulqdq") != 0;
}

// The helpers are always inlined, so that in the AVX-512 loop they are VEX-encoded too: a
// call to SSE code from there costs a vzeroupper and the reload of every power, each time.
#define KVO_CLMUL __attribute__((target("pclmul,ssse3,sse2")))
#define KVO_INLINE __attribute__((target("pclmul,ssse3,sse2"), always_inline))
#define KVO_WIDE __attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,ssse3")))

KVO_INLINE inline __m128i gh_bswap(__m128i v) {
  return _mm_shuffle_epi8(v, _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// The 256-bit carry-less product a*b as (lo, hi), unreduced.
KVO_INLINE inline void gh_mul_wide(__m128i a, __m128i b, __m128i& lo, __m128i& hi) {
  __m128i mid = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x10), _mm_clmulepi64_si128(a, b, 0x01));
  lo = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x00), _mm_slli_si128(mid, 8));
  hi = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x11), _mm_srli_si128(mid, 8));
}

// (lo, hi) shifted left by one bit and reduced: the GCM product of byte-reversed values.
KVO_INLINE inline __m128i gh_reduce(__m128i lo, __m128i hi) {
  __m128i t7 = _mm_srli_epi32(lo, 31);
  __m128i t8 = _mm_srli_epi32(hi, 31);
  lo = _mm_slli_epi32(lo, 1);
  hi = _mm_slli_epi32(hi, 1);
  __m128i t9 = _mm_srli_si128(t7, 12);
  t8 = _mm_slli_si128(t8, 4);
  t7 = _mm_slli_si128(t7, 4);
  lo = _mm_or_si128(lo, t7);
  hi = _mm_or_si128(_mm_or_si128(hi, t8), t9);
  t7 = _mm_xor_si128(_mm_xor_si128(_mm_slli_epi32(lo, 31), _mm_slli_epi32(lo, 30)), _mm_slli_epi32(lo, 25));
  t8 = _mm_srli_si128(t7, 4);
  t7 = _mm_slli_si128(t7, 12);
  lo = _mm_xor_si128(lo, t7);
  __m128i t2 = _mm_xor_si128(_mm_xor_si128(_mm_srli_epi32(lo, 1), _mm_srli_epi32(lo, 2)), _mm_srli_epi32(lo, 7));
  t2 = _mm_xor_si128(t2, t8);
  lo = _mm_xor_si128(lo, t2);
  return _mm_xor_si128(hi, lo);
}

KVO_INLINE inline __m128i gh_mul(__m128i a, __m128i b) {
  __m128i lo, hi;
  gh_mul_wide(a, b, lo, hi);
  return gh_reduce(lo, hi);
}

KVO_INLINE inline __m128i gh_load(const uint8_t* p) {
  return gh_bswap(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

KVO_INLINE inline __m128i gh_pow(const GhashState& s, int k) {  // H^k, 1 <= k <= 32
  return _mm_load_si128(reinterpret_cast<const __m128i*>(s.pow[kGhashPowers - k]));
}

// Whole blocks with PCLMULQDQ: four per reduction, then one at a time.
KVO_CLMUL inline __m128i gh_blocks_clmul(const GhashState& s, __m128i x, const uint8_t* p, size_t nblocks) {
  const __m128i h1 = gh_pow(s, 1), h2 = gh_pow(s, 2), h3 = gh_pow(s, 3), h4 = gh_pow(s, 4);
  for (; nblocks >= 4; nblocks -= 4, p += 64) {
    __m128i lo, hi, l, h;
    gh_mul_wide(_mm_xor_si128(x, gh_load(p)), h4, lo, hi);
    gh_mul_wide(gh_load(p + 16), h3, l, h);
    lo = _mm_xor_si128(lo, l), hi = _mm_xor_si128(hi, h);
    gh_mul_wide(gh_load(p + 32), h2, l, h);
    lo = _mm_xor_si128(lo, l), hi = _mm_xor_si128(hi, h);
    gh_mul_wide(gh_load(p + 48), h1, l, h);
    x = gh_reduce(_mm_xor_si128(lo, l), _mm_xor_si128(hi, h));
  }
  for (; nblocks; --nblocks, p += 16) x = gh_mul(_mm_xor_si128(x, gh_load(p)), h1);
  return x;
}

KVO_WIDE inline __m512i gh_load4(const uint8_t* p) {
  const __m512i rev = _mm512_broadcast_i32x4(_mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  return _mm512_shuffle_epi8(_mm512_loadu_si512(p), rev);
}

KVO_WIDE inline __m128i gh_fold4(__m512i v) {  // the xor of a register's four 128-bit lanes
  __m256i t = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  return _mm_xor_si128(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
}

// Whole blocks with VPCLMULQDQ: 32 per reduction (eight registers of four blocks, multiplied
// by H^32..H^1 lane by lane), the rest as gh_blocks_clmul.  Only the first register depends
// on the previous reduction, so the products of the other seven overlap its latency.
KVO_WIDE inline __m128i gh_blocks_wide(const GhashState& s, __m128i x, const uint8_t* p, size_t nblocks) {
  const auto* pw = reinterpret_cast<const __m512i*>(s.pow);
  __m512i pk[8];
  for (int k = 0; k < 8; ++k) pk[k] = _mm512_load_si512(pw + k);
  for (; nblocks >= 32; nblocks -= 32, p += 512) {
    for (int k = 0; k < 8; ++k) _mm_prefetch(reinterpret_cast<const char*>(p + kGhashAhead + 64 * k), _MM_HINT_T0);
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512(), mid = _mm512_setzero_si512();
    for (int k = 7; k >= 1; --k) {
      const __m512i a = gh_load4(p + 64 * k);
      lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(a, pk[k], 0x00));
      hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(a, pk[k], 0x11));
      mid = _mm512_ternarylogic_epi64(mid, _mm512_clmulepi64_epi128(a, pk[k], 0x01),
                                      _mm512_clmulepi64_epi128(a, pk[k], 0x10), 0x96);
    }
    const __m512i a = _mm512_xor_si512(gh_load4(p), _mm512_zextsi128_si512(x));
    lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(a, pk[0], 0x00));
    hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(a, pk[0], 0x11));
    mid = _mm512_ternarylogic_epi64(mid, _mm512_clmulepi64_epi128(a, pk[0], 0x01),
                                    _mm512_clmulepi64_epi128(a, pk[0], 0x10), 0x96);
    lo = _mm512_xor_si512(lo, _mm512_bslli_epi128(mid, 8));
    hi = _mm512_xor_si512(hi, _mm512_bsrli_epi128(mid, 8));
    x = gh_reduce(gh_fold4(lo), gh_fold4(hi));
  }
  return gh_blocks_clmul(s, x, p, nblocks);
}

KVO_CLMUL inline void ghash_init(GhashState& s, const uint8_t h[16]) {
  s.wide = ghash_have_wide();
  const __m128i hv = gh_load(h);
  __m128i pw = hv;
  for (int k = 1; k <= kGhashPowers; ++k) {
    _mm_store_si128(reinterpret_cast<__m128i*>(s.pow[kGhashPowers - k]), pw);
    pw = gh_mul(pw, hv);
  }
}

// Hash `n` more bytes (blocks may straddle calls: the tail waits in `part`).
KVO_CLMUL inline void ghash_update(GhashState& s, const uint8_t* p, size_t n) {
  s.total += n;
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.x));
  if (s.part_len) {
    const size_t k = n < 16 - s.part_len ? n : 16 - s.part_len;
    std::memcpy(s.part + s.part_len, p, k);
    s.part_len += k, p += k, n -= k;
    if (s.part_len < 16) return;
    x = gh_blocks_clmul(s, x, s.part, 1);
    s.part_len = 0;
  }
  const size_t nblocks = n / 16;
  x = s.wide ? gh_blocks_wide(s, x, p, nblocks) : gh_blocks_clmul(s, x, p, nblocks);
  p += nblocks * 16, n -= nblocks * 16;
  std::memcpy(s.part, p, n);
  s.part_len = n;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(s.x), x);
}

// GHASH_H(A || 0-pad || len(A) || len(C)=0) of everything hashed, with all of it as the
// associated data A (GMAC); `s` is left as it was.
KVO_CLMUL inline void ghash_digest(const GhashState& s, uint8_t out[16]) {
  __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s.x));
  if (s.part_len) {
    uint8_t last[16] = {};
    std::memcpy(last, s.part, s.part_len);
    x = gh_blocks_clmul(s, x, last, 1);
  }
  uint8_t len[16] = {};
  const uint64_t bits = s.total * 8;
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  x = gh_blocks_clmul(s, x, len, 1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), gh_bswap(x));
}

#undef KVO_CLMUL
#undef KVO_INLINE
#undef KVO_WIDE

#else  // not x86-64: no GHASH here; the MAC is cryptography's GMAC (offload/copier.py ghash_available)

inline bool ghash_have_clmul() { return false; }
inline void ghash_init(GhashState&, const uint8_t*) {}
inline void ghash_update(GhashState&, const uint8_t*, size_t) {}
inline void ghash_digest(const GhashState&, uint8_t*) {}

#endif

}  // namespace kvoffload
