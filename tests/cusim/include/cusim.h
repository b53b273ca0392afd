// cusim: run CUDA kernel sources on the CPU, one fiber per CUDA thread.
//
// Force-included (g++ -include cusim.h) in front of a kernels/*.cu file that
// tests/cusim/build.py has rewritten (its __shared__ declarations become per-block arena
// lookups). Semantics kept from CUDA, because the kernels depend on them:
//   - a block's threads run as fibers on one OS thread; a fiber runs until it reaches a
//     barrier (__syncthreads) or a warp collective (shuffles, match, __syncwarp), so all
//     writes before a barrier are visible after it, and nothing else is promised;
//   - the order in which fibers run between barriers is shuffled per launch (seeded), so a
//     kernel whose result depends on an unsynchronized read of another thread's write
//     gives different answers from launch to launch instead of silently "working";
//   - __syncthreads completes when every thread that has not exited reached it;
//   - a warp collective completes when every lane named in its mask reached the same
//     collective; a named lane that exited, does not exist, or waits elsewhere is an error
//     (on a GPU: undefined behaviour or a hang), as is a block that can make no progress;
//   - shared memory (static and dynamic) starts filled with 0xFF bytes (NaN floats, -1
//     ints), and writes past the dynamic shared-memory size are reported.
// Errors end the launch; cusim_last_error() says which block and thread and why.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <csetjmp>
#include <cstring>
#include <string>
#include <ucontext.h>
#include <unordered_map>
#include <vector>

#ifndef __global__
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };

namespace cusim {

enum State { RUNNABLE, AT_BARRIER, AT_WARP, DONE };

struct Thread {
    ucontext_t ctx;           // the first entry (makecontext/setcontext)
    jmp_buf jb;               // every later resume (_setjmp/_longjmp: no signal-mask syscall)
    bool started = false;
    uint3 idx;
    int linear = 0;
    State state = RUNNABLE;
    unsigned warp_mask = 0;   // AT_WARP: the mask and kind of collective waited on
    int warp_op = 0;
    uint64_t slot = 0;        // this lane's contribution to the collective
};

struct Launch {
    uint3 block_idx{0, 0, 0};
    dim3 block_dim, grid_dim;
    std::vector<Thread> threads;
    Thread* cur = nullptr;
    jmp_buf scheduler;
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
    std::vector<unsigned char> dyn_smem;   // dynamic shared memory + canary tail
    size_t dyn_bytes = 0;
    std::unordered_map<int, std::vector<unsigned char>> static_smem;  // site -> block's array
    std::string error;
    uint64_t rng = 0;
};

inline Launch* g = nullptr;
constexpr size_t kCanary = 4096;   // bytes of 0xFF checked after the dynamic shared memory
constexpr size_t kStack = 64 * 1024;
inline std::vector<std::vector<char>>& stacks() {
    static std::vector<std::vector<char>> s;
    return s;
}

inline void fail(const std::string& why) {
    if (g->error.empty()) {
        char where[160];
        std::snprintf(where, sizeof where, "block (%u,%u,%u) thread (%u,%u,%u): ", g->block_idx.x,
                      g->block_idx.y, g->block_idx.z, g->cur ? g->cur->idx.x : 0,
                      g->cur ? g->cur->idx.y : 0, g->cur ? g->cur->idx.z : 0);
        g->error = where + why;
    }
}

inline void yield() {
    if (!_setjmp(g->cur->jb)) _longjmp(g->scheduler, 1);
}

inline void trampoline() {
    g->body(g->body_arg);
    g->cur->state = DONE;
    _longjmp(g->scheduler, 1);
}

inline void resume(Thread& t) {
    g->cur = &t;
    if (_setjmp(g->scheduler)) return;   // back from the fiber
    if (!t.started) {
        t.started = true;
        setcontext(&t.ctx);
    }
    _longjmp(t.jb, 1);
}

// ---- warp collectives: each lane posts its value, waits for its peers, reads a peer's ----
enum Op { OP_SHFL = 1, OP_SHFL_XOR, OP_SHFL_UP, OP_SHFL_DOWN, OP_MATCH, OP_SYNCWARP, OP_BALLOT,
          OP_ANY, OP_ALL, OP_DONE_READING = 100 };

inline int lane_of(const Thread* t) { return t->linear % 32; }
inline Thread* lane_thread(const Thread* t, int lane) {
    const size_t i = (size_t)(t->linear / 32) * 32 + lane;
    return i < g->threads.size() ? &g->threads[i] : nullptr;
}

inline void warp_wait(unsigned mask, int op, uint64_t value) {
    Thread* t = g->cur;
    if (!(mask >> lane_of(t) & 1u)) fail("a warp collective's mask does not name the calling lane");
    t->state = AT_WARP;
    t->warp_mask = mask;
    t->warp_op = op;
    if (op != OP_DONE_READING) t->slot = value;   // peers may still be reading the old one
    yield();
}

// Post, wait for every lane of the mask, read, then wait again so no lane overwrites its
// slot (in the next collective) before every peer has read it.
template <typename F>
inline uint64_t warp_collective(unsigned mask, int op, uint64_t value, F read) {
    warp_wait(mask, op, value);
    const uint64_t result = read(g->cur);
    warp_wait(mask, OP_DONE_READING, 0);
    return result;
}

template <typename T>
inline uint64_t bits_of(T v) {
    static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

template <typename T>
inline T shfl_from(unsigned mask, int op, T v, int (*src)(int lane, int arg), int arg, int width) {
    if (width <= 0 || width > 32 || (width & (width - 1))) fail("shuffle width must be a power of 2 <= 32");
    const uint64_t out = warp_collective(mask, op, bits_of(v), [&](Thread* t) {
        const int lane = lane_of(t);
        const int base = lane & ~(width - 1);
        int s = src(lane - base, arg);
        if (s < 0 || s >= width) s = lane - base;   // out of the segment: own value
        s += base;
        if (!(mask >> s & 1u)) {   // reading a lane outside the mask is undefined on a GPU
            fail("a shuffle reads a lane its mask does not name");
            return t->slot;
        }
        return lane_thread(t, s)->slot;
    });
    return from_bits<T>(out);
}

inline int src_idx(int, int a) { return a; }
inline int src_xor(int l, int a) { return l ^ a; }
inline int src_up(int l, int a) { return l - a; }
inline int src_down(int l, int a) { return l + a; }

// ---- shared memory ------------------------------------------------------------------------
template <typename T>
inline T& shared_array(int site) {
    auto& mem = g->static_smem[site];
    if (mem.empty()) mem.assign(sizeof(T), 0xFF);   // first thread of the block to get here
    return *reinterpret_cast<T*>(mem.data());
}

inline void* dynamic_shared() { return g->dyn_smem.data(); }

// ---- the launch -----------------------------------------------------------------------------
inline uint64_t next_random() {
    g->rng ^= g->rng << 13;
    g->rng ^= g->rng >> 7;
    g->rng ^= g->rng << 17;
    return g->rng;
}

// Release the collective of the warp containing thread i if all of its lanes arrived.
inline bool try_release_warp(size_t first) {
    Thread* t0 = nullptr;
    for (size_t i = first; i < first + 32 && i < g->threads.size(); ++i)
        if (g->threads[i].state == AT_WARP) { t0 = &g->threads[i]; break; }
    if (!t0) return false;
    const unsigned mask = t0->warp_mask;
    for (int lane = 0; lane < 32; ++lane) {
        if (!(mask >> lane & 1u)) continue;
        Thread* p = lane_thread(t0, lane);
        g->cur = t0;
        if (!p) { fail("a warp collective's mask names a lane beyond the block's threads"); return false; }
        if (p->state == DONE) { g->cur = p; fail("a warp collective waits for this lane, which has exited"); return false; }
        if (p->state != AT_WARP) return false;   // not there yet
        if (p->warp_mask != mask || p->warp_op != t0->warp_op) {
            g->cur = p;
            fail("lanes of one warp wait at different warp collectives (or with different masks)");
            return false;
        }
    }
    for (int lane = 0; lane < 32; ++lane)
        if (mask >> lane & 1u) lane_thread(t0, lane)->state = RUNNABLE;
    return true;
}

inline void run_block() {
    const size_t n = g->threads.size();
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    for (;;) {
        // shuffled run order between synchronisation points
        for (size_t i = n; i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
        bool ran = false;
        for (size_t i : order) {
            Thread& t = g->threads[i];
            if (t.state != RUNNABLE) continue;
            resume(t);
            ran = true;
            if (!g->error.empty()) return;
        }
        bool released = false;
        for (size_t w = 0; w < n; w += 32) {
            released |= try_release_warp(w);
            if (!g->error.empty()) return;
        }
        size_t done = 0, at_barrier = 0, at_warp = 0;
        for (auto& t : g->threads) {
            done += t.state == DONE;
            at_barrier += t.state == AT_BARRIER;
            at_warp += t.state == AT_WARP;
        }
        if (done == n) return;
        if (!ran && !released) {
            if (at_warp == 0 && at_barrier + done == n) {   // every live thread is at the barrier
                for (auto& t : g->threads)
                    if (t.state == AT_BARRIER) t.state = RUNNABLE;
                continue;
            }
            for (auto& t : g->threads)
                if (t.state == AT_WARP) { g->cur = &t; break; }
            fail("deadlock: some threads wait at __syncthreads while others wait at a warp "
                 "collective that cannot complete");
            return;
        }
    }
}

}  // namespace cusim

// ---- the CUDA built-ins the kernels use -------------------------------------------------------
#define threadIdx (cusim::g->cur->idx)
#define blockIdx (cusim::g->block_idx)
#define blockDim (cusim::g->block_dim)
#define gridDim (cusim::g->grid_dim)
#define warpSize 32

inline void __syncthreads() {
    cusim::g->cur->state = cusim::AT_BARRIER;
    cusim::yield();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    cusim::warp_collective(mask, cusim::OP_SYNCWARP, 0, [](cusim::Thread*) { return (uint64_t)0; });
}
inline void __threadfence() {}
inline void __threadfence_block() {}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return cusim::shfl_from(mask, cusim::OP_SHFL, v, cusim::src_idx, src, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return cusim::shfl_from(mask, cusim::OP_SHFL_XOR, v, cusim::src_xor, lane_mask, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cusim::shfl_from(mask, cusim::OP_SHFL_UP, v, cusim::src_up, (int)delta, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cusim::shfl_from(mask, cusim::OP_SHFL_DOWN, v, cusim::src_down, (int)delta, width);
}
template <typename T>
inline unsigned __match_any_sync(unsigned mask, T v) {
    return (unsigned)cusim::warp_collective(mask, cusim::OP_MATCH, cusim::bits_of(v), [&](cusim::Thread* t) {
        uint64_t peers = 0;
        for (int l = 0; l < 32; ++l)
            if ((mask >> l & 1u) && cusim::lane_thread(t, l)->slot == t->slot) peers |= 1ull << l;
        return peers;
    });
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)cusim::warp_collective(mask, cusim::OP_BALLOT, pred != 0, [&](cusim::Thread* t) {
        uint64_t bits = 0;
        for (int l = 0; l < 32; ++l)
            if ((mask >> l & 1u) && cusim::lane_thread(t, l)->slot) bits |= 1ull << l;
        return bits;
    });
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == mask; }

template <typename T>
inline T atomicAdd(T* p, T v) {   // fibers never run concurrently: a plain update is atomic
    T old = *p;
    *p = old + v;
    return old;
}
template <typename T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    if (v > old) *p = v;
    return old;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// CUDA's min/max take mixed integer types; std::min does not.
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) { return a > b ? a : b; }

// ---- entry point called by the generated launchers ---------------------------------------------
// Runs body(arg) as every thread of every block; returns "" or the first error.
inline const char* cusim_launch(dim3 grid, dim3 block, size_t smem, uint64_t seed,
                                void (*body)(void*), void* arg) {
    static cusim::Launch launch;
    launch = cusim::Launch();
    cusim::g = &launch;
    launch.grid_dim = grid;
    launch.block_dim = block;
    launch.body = body;
    launch.body_arg = arg;
    launch.rng = seed * 0x9E3779B97F4A7C15ull + 1;
    const size_t n = (size_t)block.x * block.y * block.z;
    auto& st = cusim::stacks();
    while (st.size() < n) st.emplace_back(cusim::kStack);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                launch.block_idx = {bx, by, bz};
                launch.static_smem.clear();
                launch.dyn_smem.assign(smem + cusim::kCanary, 0xFF);
                launch.dyn_bytes = smem;
                launch.threads.assign(n, cusim::Thread());
                for (size_t i = 0; i < n; ++i) {
                    cusim::Thread& t = launch.threads[i];
                    t.linear = (int)i;
                    t.idx = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                             (unsigned)(i / ((size_t)block.x * block.y))};
                    getcontext(&t.ctx);
                    t.ctx.uc_stack.ss_sp = st[i].data();
                    t.ctx.uc_stack.ss_size = st[i].size();
                    t.ctx.uc_link = nullptr;
                    makecontext(&t.ctx, cusim::trampoline, 0);
                }
                launch.cur = nullptr;
                cusim::run_block();
                if (launch.error.empty()) {
                    for (size_t i = smem; i < smem + cusim::kCanary; ++i)
                        if (launch.dyn_smem[i] != 0xFF) {
                            launch.cur = nullptr;
                            char msg[128];
                            std::snprintf(msg, sizeof msg, "wrote past the %zu bytes of dynamic shared memory "
                                          "(byte %zu)", smem, i);
                            cusim::fail(msg);
                            break;
                        }
                }
                if (!launch.error.empty()) return launch.error.c_str();
            }
    return "";
}
