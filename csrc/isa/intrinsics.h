// <immintrin.h> for the loops of csrc/isa/, without GCC 12's false warnings about it: its AVX-512 intrinsics that
// leave lanes undefined (_mm512_cvtepi32_ps, _mm512_extracti64x4_epi64, ... through _mm*_undefined_*) report
// "'__Y' may be used uninitialized" at every inlined use (hundreds a build; GCC bug 105593, mended in GCC 13). The
// warning is off for the header's own lines only: a use in our code is still checked.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
