// Pick the widest ATen vector ISA the compiler targets (the CPU build uses -march=native and is cached
// per machine). The namespace names are our own so these inline instantiations never collide with the
// ones inside libtorch (Note [CPU_CAPABILITY namespace] in ATen/cpu/vec/vec.h). Include first.
#pragma once
#if !defined(CPU_CAPABILITY)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512 1
#define CPU_CAPABILITY lite_boost_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2 1
#define CPU_CAPABILITY lite_boost_avx2
#else
#define CPU_CAPABILITY lite_boost_default
#endif
#endif
