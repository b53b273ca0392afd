// cusim: run CUDA kernel sources on the CPU, one fiber per CUDA thread.
//
// Force-included (g++ -include cusim.h) in front of a kernels/*.cu file that
// tests/cusim/build.py has rewritten (its __shared__ declarations become per-block arena
// lookups). Semantics kept from CUDA, because the kernels depend on them:
//   - a block's threads run as fibers on one OS thread; a fiber runs until it reaches a
//     barrier (__syncthreads) or a warp collective (shuffles, match, ballot, __syncwarp), so
//     writes before a barrier are visible after it, and nothing else is promised;
//   - scheduling is per warp and random (seeded per launch): a chosen warp runs its lanes (in
//     shuffled order) until each blocks, and its collective completes at once. Per launch,
//     warps either interleave at every collective, or mostly keep running, or run until
//     they wait at __syncthreads, so one warp can get far ahead of the others, as on a GPU.
//     A kernel reading another warp's (or lane's) write without a barrier gets
//     launch-dependent results instead of passing by luck. Blocks run one after another,
//     in a random order;
//   - __syncthreads completes when every thread that has not exited reached it;
//   - a warp collective completes when every lane named in its mask reached the same
//     collective with the same mask; a named lane that exited or does not exist is an error,
//     lanes of one group waiting at different collectives are reported when the block can
//     make no progress (a deadlock), as is any other deadlock;
//   - shared memory (static and dynamic) starts as 0xFF bytes (NaN floats, -1 ints); 4 KiB of
//     0xFE canary after the dynamic shared memory catch writes past it; static + dynamic
//     shared memory is checked against the launch's limit;
//   - fiber stacks are 256 KiB, mmap'ed with a guard page; a fault in a kernel (SIGSEGV,
//     SIGBUS, SIGFPE) ends the launch with an error instead of killing the process, and so
//     does a launch that runs 120 s of CPU time (a spin-wait: fibers are not preempted).
// Errors end the launch; cusim_launch returns which block and thread and why.
#pragma once

#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <csignal>
#include <pthread.h>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <sys/time.h>
#include <typeinfo>
#include <ucontext.h>
#include <unordered_map>
#include <vector>

#ifndef __global__
#define __global__
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900   // the simulated device: an H100/H200 (sm_90); -D__CUDA_ARCH__=800 for Ampere
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#define __align__(n) alignas(n)

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float2 make_float2(float x, float y) { return float2{x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace cusim {

enum State { RUNNABLE, AT_BARRIER, AT_WARP, DONE };

struct AsyncCopy {           // a cp.async issued and not yet waited for
    unsigned char* dst;
    const unsigned char* src;
    int bytes, src_bytes;       // bytes beyond src_bytes are zero-filled
    int group;                  // -1 until cp.async.commit_group
};

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
    std::vector<AsyncCopy> copies;   // cp.async: they land at cp.async.wait_group, not before
    int committed = 0;        // cp.async groups committed so far
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
    std::unordered_map<std::string, std::vector<unsigned char>> static_smem;  // site+type -> array
    size_t static_bytes = 0;
    std::string error;
    uint64_t rng = 0;
    bool async_eager = false;   // cp.async copies land at issue (else at their wait), per launch
    volatile bool in_fiber = false;   // a fiber runs (not the scheduler): faults can leave it
};

inline Launch* g = nullptr;
constexpr size_t kCanary = 4096;        // bytes of 0xFE checked after the dynamic shared memory
constexpr unsigned char kFill = 0xFF;   // fresh shared memory
constexpr unsigned char kGuard = 0xFE;  // canary (differs from kFill: -1 / NaN writes show)
constexpr size_t kStack = 256 * 1024;
inline long g_max_dyn = -1;             // the kernel's max dynamic shared memory; -1: CUDA's default

struct Stack {
    char* base = nullptr;   // guard page, then kStack usable bytes
};
inline std::vector<Stack>& stacks() {
    static std::vector<Stack> s;
    return s;
}
inline char* stack_for(size_t i) {
    auto& st = stacks();
    while (st.size() <= i) {
        const size_t page = 4096;
        void* p = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
        if (p == MAP_FAILED) return nullptr;
        mprotect(p, page, PROT_NONE);   // stacks grow down: an overflow faults instead of corrupting
        st.push_back(Stack{static_cast<char*>(p)});
    }
    return st[i].base + 4096;
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
    if (_setjmp(g->scheduler)) {   // back from the fiber
        g->in_fiber = false;
        return;
    }
    g->in_fiber = true;
    if (!t.started) {
        t.started = true;
        setcontext(&t.ctx);
    }
    _longjmp(t.jb, 1);
}

inline uint64_t next_random() {
    g->rng ^= g->rng << 13;
    g->rng ^= g->rng >> 7;
    g->rng ^= g->rng << 17;
    return g->rng;
}

// ---- warp collectives: each lane posts its value, waits for its peers, reads a peer's ----
enum Op { OP_SHFL = 1, OP_SHFL_XOR, OP_SHFL_UP, OP_SHFL_DOWN, OP_MATCH, OP_SYNCWARP, OP_BALLOT,
          OP_DONE_READING = 100 };

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

// The source lane of a shuffle, by CUDA's rules for a segment of `width` lanes starting at
// `base`; -1: the lane's own value.
inline int shfl_source(int op, int lane, int arg, int width) {
    const int base = lane & ~(width - 1);
    switch (op) {
        case OP_SHFL: return base + (arg & (width - 1));                  // srcLane modulo width
        case OP_SHFL_UP: return lane - arg >= base ? lane - arg : -1;
        case OP_SHFL_DOWN: return lane + arg < base + width ? lane + arg : -1;
        default: {                                                        // xor: earlier groups ok,
            const int j = lane ^ arg;                                     // later ones give own value
            return j < base + width ? j : -1;
        }
    }
}

template <typename T>
inline T shfl(unsigned mask, int op, T v, int arg, int width) {
    if (width <= 0 || width > 32 || (width & (width - 1))) fail("shuffle width must be a power of 2 <= 32");
    const uint64_t out = warp_collective(mask, op, bits_of(v), [&](Thread* t) {
        const int s = shfl_source(op, lane_of(t), arg, width);
        if (s < 0 || s == lane_of(t)) return t->slot;
        if (s > 31 || !(mask >> s & 1u)) {   // reading a lane outside the mask is undefined on a GPU
            fail("a shuffle reads a lane its mask does not name");
            return t->slot;
        }
        return lane_thread(t, s)->slot;
    });
    return from_bits<T>(out);
}

// ---- shared memory ------------------------------------------------------------------------
template <typename T>
inline T& shared_array(int site) {
    const std::string key = std::to_string(site) + typeid(T).name();   // per template instance
    auto& mem = g->static_smem[key];
    if (mem.empty()) {   // the first thread of the block to get here
        mem.assign(sizeof(T), kFill);
        g->static_bytes += sizeof(T);
    }
    return *reinterpret_cast<T*>(mem.data());
}

inline void* dynamic_shared() { return g->dyn_smem.data(); }

// ---- scheduling -----------------------------------------------------------------------------
// Complete every collective of warp w whose lanes have all arrived; errors for named lanes
// that exited or do not exist.
inline bool release_warp(size_t w) {
    bool released = false;
    const size_t first = w * 32, n = g->threads.size();
    for (size_t i = first; i < first + 32 && i < n; ++i) {
        Thread* t0 = &g->threads[i];
        if (t0->state != AT_WARP) continue;
        const unsigned mask = t0->warp_mask;
        bool ready = true;
        for (int lane = 0; lane < 32 && ready; ++lane) {
            if (!(mask >> lane & 1u)) continue;
            Thread* p = lane_thread(t0, lane);
            g->cur = t0;
            if (!p) { fail("a warp collective's mask names a lane beyond the block's threads"); return false; }
            if (p->state == DONE) { g->cur = p; fail("a warp collective waits for this lane, which has exited"); return false; }
            ready = p->state == AT_WARP && p->warp_mask == mask && p->warp_op == t0->warp_op;
        }
        if (!ready) continue;
        for (int lane = 0; lane < 32; ++lane)
            if (mask >> lane & 1u) lane_thread(t0, lane)->state = RUNNABLE;
        released = true;
    }
    return released;
}

inline void diagnose_deadlock() {
    for (auto& t : g->threads) {
        if (t.state != AT_WARP) continue;
        for (int lane = 0; lane < 32; ++lane) {
            Thread* p = lane_thread(&t, lane);
            if ((t.warp_mask >> lane & 1u) && p && p->state == AT_WARP &&
                (p->warp_mask != t.warp_mask || p->warp_op != t.warp_op)) {
                g->cur = p;
                fail("lanes of one warp wait at different warp collectives (or with different masks)");
                return;
            }
        }
        g->cur = &t;
        fail("deadlock: a warp collective cannot complete (its lanes wait at __syncthreads or elsewhere)");
        return;
    }
    g->cur = nullptr;
    fail("deadlock");
}

// How long a warp keeps running once picked, chosen per launch: 0 interleaves the warps at
// every collective; 90 (percent) lets one run ahead often; 100 runs each warp until it waits
// at __syncthreads or exits (the largest skew between warps a GPU could show).
inline int pick_stickiness() {
    static const int choices[] = {0, 90, 100};
    return choices[next_random() % 3];
}

inline void run_block(int stickiness) {
    const size_t n = g->threads.size(), nwarps = (n + 31) / 32;
    std::vector<size_t> ready, lanes;
    size_t current = (size_t)-1;
    for (;;) {
        ready.clear();
        bool current_ready = false;
        for (size_t w = 0; w < nwarps; ++w)
            for (size_t i = w * 32; i < w * 32 + 32 && i < n; ++i)
                if (g->threads[i].state == RUNNABLE) {
                    ready.push_back(w);
                    current_ready |= w == current;
                    break;
                }
        if (!ready.empty()) {   // run one warp's lanes until each blocks
            const bool stay = current_ready && (int)(next_random() % 100) < stickiness;
            const size_t w = stay ? current : ready[next_random() % ready.size()];
            current = w;
            lanes.clear();
            for (size_t i = w * 32; i < w * 32 + 32 && i < n; ++i)
                if (g->threads[i].state == RUNNABLE) lanes.push_back(i);
            for (size_t i = lanes.size(); i > 1; --i) std::swap(lanes[i - 1], lanes[next_random() % i]);
            for (size_t i : lanes) {
                resume(g->threads[i]);
                if (!g->error.empty()) return;
            }
            release_warp(w);
            if (!g->error.empty()) return;
            continue;
        }
        size_t done = 0, at_barrier = 0;
        for (auto& t : g->threads) {
            done += t.state == DONE;
            at_barrier += t.state == AT_BARRIER;
        }
        if (done == n) return;
        if (at_barrier + done == n) {   // every live thread is at __syncthreads
            for (auto& t : g->threads)
                if (t.state == AT_BARRIER) t.state = RUNNABLE;
            continue;
        }
        diagnose_deadlock();
        return;
    }
}

}  // namespace cusim

// ---- faults inside a kernel ------------------------------------------------------------------------
// A SIGSEGV/SIGBUS (an access far out of bounds, a fiber stack overflowing into its guard
// page) or SIGFPE (integer division by zero) in a fiber ends the launch with an error naming
// the thread, instead of killing the process. The handler runs on its own stack; the fiber
// is abandoned (never resumed). Installed only while a launch runs.
namespace cusim {
#ifndef CUSIM_WATCHDOG_SECONDS
#define CUSIM_WATCHDOG_SECONDS 120
#endif
constexpr long kWatchdogSeconds = CUSIM_WATCHDOG_SECONDS;   // CPU time before a launch counts as hung

inline pthread_t g_launcher;   // the thread running the launch (faults elsewhere are not ours)

inline void on_fault(int sig, siginfo_t* info, void*) {
    if (!pthread_equal(pthread_self(), g_launcher)) {   // another thread of the process
        if (sig != SIGVTALRM) signal(sig, SIG_DFL);      // its fault: crash as usual
        return;
    }
    char msg[160];
    if (sig == SIGVTALRM)
        std::snprintf(msg, sizeof msg, "the launch ran %ld s of CPU time without finishing (a thread "
                      "spinning on another's write? fibers are not preempted)", kWatchdogSeconds);
    else if (sig == SIGFPE)
        std::snprintf(msg, sizeof msg, "arithmetic fault (SIGFPE: an integer division by zero?)");
    else
        std::snprintf(msg, sizeof msg, "invalid memory access (%s at address %p: out of bounds, or a "
                      "stack overflow)", sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", info->si_addr);
    if (!g || !g->in_fiber) {    // the scheduler itself, not a kernel
        if (sig != SIGVTALRM) signal(sig, SIG_DFL);   // a fault in cusim: crash as usual
        else fail(msg);                                 // the watchdog: it stops on the error
        return;
    }
    fail(msg);
    g->cur->state = DONE;
    _longjmp(g->scheduler, 1);   // SA_NODEFER: the signal is not left blocked
}

struct FaultGuard {
    struct sigaction old[4];
    stack_t old_stack;
    static constexpr int sigs[4] = {SIGSEGV, SIGBUS, SIGFPE, SIGVTALRM};
    FaultGuard() {
        static std::vector<char> alt(64 * 1024);
        stack_t st{};
        st.ss_sp = alt.data();
        st.ss_size = alt.size();
        sigaltstack(&st, &old_stack);
        struct sigaction sa{};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        g_launcher = pthread_self();
        for (int i = 0; i < 4; ++i) sigaction(sigs[i], &sa, &old[i]);
        itimerval watchdog{};
        watchdog.it_value.tv_sec = kWatchdogSeconds;
        setitimer(ITIMER_VIRTUAL, &watchdog, nullptr);
    }
    ~FaultGuard() {
        itimerval off{};
        setitimer(ITIMER_VIRTUAL, &off, nullptr);
        for (int i = 0; i < 4; ++i) sigaction(sigs[i], &old[i], nullptr);
        sigaltstack(&old_stack, nullptr);
    }
};
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
    return cusim::shfl(mask, cusim::OP_SHFL, v, src, width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return cusim::shfl(mask, cusim::OP_SHFL_XOR, v, lane_mask, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cusim::shfl(mask, cusim::OP_SHFL_UP, v, (int)delta, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cusim::shfl(mask, cusim::OP_SHFL_DOWN, v, (int)delta, width);
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

template <typename T, typename U>
inline T atomicAdd(T* p, U v) {   // fibers never run concurrently: a plain update is atomic
    T old = *p;
    *p = old + (T)v;
    return old;
}
template <typename T, typename U>
inline T atomicMax(T* p, U v) {
    T old = *p;
    if ((T)v > old) *p = (T)v;
    return old;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(unsigned v) { return v ? __builtin_clz(v) : 32; }
inline int __ffs(unsigned v) { return __builtin_ffs((int)v); }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }  // no -march: the host never contracts to FMA
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// CUDA's min/max: integers of mixed types, and fminf/fmaxf (NaN-ignoring) for floats.
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

#include "cusim_ptx.h"   // inline PTX: mma.sync, ldmatrix, cvt (rewritten asm statements call cusim::ptx)

// ---- entry points called from Python ------------------------------------------------------------
// The launch's limit on dynamic shared memory (the kernel attribute; -1: CUDA's default of
// 48 KiB minus the kernel's static shared memory).
extern "C" void cusim_set_max_dynamic_shared(long bytes) { cusim::g_max_dyn = bytes; }

// Runs body(arg) as every thread of every block; returns "" or the first error.
inline const char* cusim_launch(dim3 grid, dim3 block, size_t smem, uint64_t seed,
                                void (*body)(void*), void* arg) {
    static cusim::Launch launch;
    cusim::FaultGuard guard;
    launch = cusim::Launch();
    cusim::g = &launch;
    launch.grid_dim = grid;
    launch.block_dim = block;
    launch.body = body;
    launch.body_arg = arg;
    launch.rng = seed * 0x9E3779B97F4A7C15ull + 1;
    const size_t n = (size_t)block.x * block.y * block.z;
    std::vector<uint3> order;   // blocks in a random order
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) order.push_back({bx, by, bz});
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[cusim::next_random() % i]);
    bool first = true;
    const int stickiness = cusim::pick_stickiness();
    launch.async_eager = cusim::next_random() % 2;
    for (const uint3& b : order) {
        launch.block_idx = b;
        launch.static_smem.clear();
        launch.static_bytes = 0;
        launch.dyn_smem.assign(smem, cusim::kFill);
        launch.dyn_smem.resize(smem + cusim::kCanary, cusim::kGuard);
        launch.threads.assign(n, cusim::Thread());
        for (size_t i = 0; i < n; ++i) {
            cusim::Thread& t = launch.threads[i];
            t.linear = (int)i;
            t.idx = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                     (unsigned)(i / ((size_t)block.x * block.y))};
            char* stack = cusim::stack_for(i);
            if (!stack) return "cusim: cannot map a fiber stack";
            getcontext(&t.ctx);
            t.ctx.uc_stack.ss_sp = stack;
            t.ctx.uc_stack.ss_size = cusim::kStack;
            t.ctx.uc_link = nullptr;
            makecontext(&t.ctx, cusim::trampoline, 0);
        }
        launch.cur = nullptr;
        cusim::run_block(stickiness);
        if (launch.error.empty()) {
            for (size_t i = smem; i < smem + cusim::kCanary; ++i)
                if (launch.dyn_smem[i] != cusim::kGuard) {
                    launch.cur = nullptr;
                    char msg[128];
                    std::snprintf(msg, sizeof msg, "wrote past the %zu bytes of dynamic shared memory "
                                  "(byte %zu)", smem, i);
                    cusim::fail(msg);
                    break;
                }
        }
        if (launch.error.empty() && first) {   // the static arrays are known once a block ran
            const long stat = (long)launch.static_bytes;
            const long limit = cusim::g_max_dyn < 0 ? 49152 - stat : cusim::g_max_dyn;
            char msg[200];
            if (stat > 49152 || (long)smem > limit) {
                launch.cur = nullptr;
                std::snprintf(msg, sizeof msg, "%ld bytes of static and %zu of dynamic shared memory "
                              "exceed the limit (dynamic at most %ld without raising "
                              "max_dynamic_shared_size_bytes)", stat, smem, limit);
                cusim::fail(msg);
            }
        }
        first = false;
        if (!launch.error.empty()) return launch.error.c_str();
    }
    return "";
}
