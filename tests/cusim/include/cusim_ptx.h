// cusim: the inline PTX the kernels use, executed with the semantics the PTX ISA documents.
//
// tests/cusim/build.py rewrites every `asm [volatile] ("template" : outputs : inputs : clobbers)`
// statement into `cusim::ptx("template", {cusim::ptx_out(x, rw), ...}, {cusim::ptx_in(y), ...})`,
// so a kernel's own PTX text runs here, operand numbering and all (outputs %0.., then inputs).
// Supported, and nothing else (an unknown instruction ends the launch with an error naming it):
//   mma.sync.aligned.m16n8k16.row.col.f32.{bf16.bf16|f16.f16}.f32  {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3}
//   mma.sync.aligned.m16n8k32.row.col.f32.{e4m3.e4m3|e5m2.e5m2}.f32  (sm_89+)
//   ldmatrix.sync.aligned.m8n8.{x1|x2|x4}[.trans].shared[::cta].b16  {r..}, [addr]
//   cvt.rn.f16x2.e4m3x2 / cvt.rn.f16x2.e5m2x2  d, a                  (sm_89+)
//   cp.async.{ca|cg}.shared.global [dst], [src], size{, src_size}; cp.async.commit_group;
//   cp.async.wait_group n; cp.async.wait_all     (sm_80+)
//   mov.b32 / mov.u32 / mov.f32  d, a|immediate
// A cp.async copy lands at the earliest or the latest moment a GPU allows, chosen per launch:
// when issued, or only when a wait_group covers its group (until then the destination keeps its
// old bytes, and the source is read at the wait). So a kernel that reads a tile before waiting
// for it reads stale data in some launches, and one that refills a buffer other warps may still
// be reading (a missing barrier) overwrites it in others. src_size < size zero-fills the rest.
// mma and ldmatrix are warp collectives over all 32 lanes (a lane that exited, or lanes at
// different instructions, is a launch error as for any collective). The fragments are placed
// by the PTX ISA's tables ("Matrix fragments for mma.m16n8k16 / .m16n8k32"): lane l is in
// group g = l / 4 at position t = l % 4, and
//   16-bit A (16x16, row):  register i, half h -> row g + 8 * (i % 2), col 2t + h + 8 * (i / 2)
//   16-bit B (16x8, col):   register i, half h -> row (k) 2t + h + 8 * i, col g
//   8-bit  A (16x32, row):  register i, byte h -> row g + 8 * (i % 2), col 4t + h + 16 * (i / 2)
//   8-bit  B (32x8, col):   register i, byte h -> row (k) 4t + h + 16 * i, col g
//   C/D f32 (16x8):         element i -> row g + 8 * (i / 2), col 2t + i % 2
// (the low half / byte of a register holds the lower element). The simulator builds its
// element -> (lane, register, part) tables from exactly these forward maps, so a kernel that
// loads a fragment any other way computes a different product here, as on a GPU.
// Arithmetic: each product of two inputs is exact in fp32 (bf16, f16 and fp8 significands are
// short enough); D[r][c] = C[r][c] + sum over k in ascending order, rounded to fp32 after each
// addition. The PTX ISA states D = A * B + C and no order; a GPU may differ in the last bits.
#pragma once

namespace cusim {

struct PtxOperand {
    void* out;       // where an output goes (nullptr: an input)
    uint64_t bits;   // an input's value, or a read-write output's value on entry
    int size;        // bytes
};

template <typename T>
inline PtxOperand ptx_out(T& v, bool read_write) {
    static_assert(sizeof(T) <= 8, "PTX operands are registers");
    return PtxOperand{&v, read_write ? bits_of(v) : 0, (int)sizeof(T)};
}
template <typename T>
inline PtxOperand ptx_in(const T& v) {
    static_assert(sizeof(T) <= 8, "PTX operands are registers");
    return PtxOperand{nullptr, bits_of(v), (int)sizeof(T)};
}

inline void ptx_write(const PtxOperand& o, uint64_t bits) {
    if (!o.out) {
        fail("an inline PTX instruction writes to an input operand");
        return;
    }
    std::memcpy(o.out, &bits, o.size);
}

// ---- element formats ------------------------------------------------------------------------
inline float f16_to_f32(uint32_t h) {
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits;
    if (e == 0x1f) bits = sign | 0x7f800000u | (m << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (m << 13);
    else {
        const float v = (float)m * (1.0f / 16777216.0f);   // subnormal: m * 2^-24
        return sign ? -v : v;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline float bf16_to_f32(uint32_t h) {
    const uint32_t bits = h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline float e4m3_to_f32(uint32_t b) {   // 1 sign, 4 exponent (bias 7), 3 mantissa; 0x7f/0xff NaN
    const float sign = (b & 0x80) ? -1.0f : 1.0f;
    const uint32_t e = (b >> 3) & 0xf, m = b & 7;
    if (e == 0xf && m == 7) return std::nanf("");
    return sign * (e ? std::ldexp(1.0f + m / 8.0f, (int)e - 7) : std::ldexp(m / 8.0f, -6));
}
inline float e5m2_to_f32(uint32_t b) { return f16_to_f32(b << 8); }   // e5m2 is the top byte of an f16
inline uint32_t f32_to_f16_exact(float v) {   // values from fp8: exactly representable
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    if (v != v) return 0x7fffu;
    const float a = std::fabs(v);
    if (a == 0.0f) return sign;
    int e;
    const float m = std::frexp(a, &e);   // a = m * 2^e, m in [0.5, 1)
    if (e - 1 < -14) return sign | (uint32_t)std::lround(a * 16777216.0f);   // subnormal f16
    return sign | ((uint32_t)(e - 1 + 15) << 10) | ((uint32_t)std::lround((m * 2.0f - 1.0f) * 1024.0f) & 0x3ffu);
}

// ---- fragment tables ----------------------------------------------------------------------
struct Holder {
    unsigned char lane, reg, part;
};

// element (row, col) of an operand -> who holds it, built from the documented forward maps
struct Layout {
    Holder a16[16][16], b16[16][8], a8[16][32], b8[32][8];
    Layout() {
        for (int l = 0; l < 32; ++l) {
            const int g = l / 4, t = l % 4;
            for (int i = 0; i < 4; ++i)
                for (int h = 0; h < 2; ++h) a16[g + 8 * (i % 2)][2 * t + h + 8 * (i / 2)] = {(unsigned char)l, (unsigned char)i, (unsigned char)h};
            for (int i = 0; i < 2; ++i)
                for (int h = 0; h < 2; ++h) b16[2 * t + h + 8 * i][g] = {(unsigned char)l, (unsigned char)i, (unsigned char)h};
            for (int i = 0; i < 4; ++i)
                for (int h = 0; h < 4; ++h) a8[g + 8 * (i % 2)][4 * t + h + 16 * (i / 2)] = {(unsigned char)l, (unsigned char)i, (unsigned char)h};
            for (int i = 0; i < 2; ++i)
                for (int h = 0; h < 4; ++h) b8[4 * t + h + 16 * i][g] = {(unsigned char)l, (unsigned char)i, (unsigned char)h};
        }
    }
};
inline const Layout& layout() {
    static const Layout table;
    return table;
}

struct MmaLane {   // what one lane brings to an mma
    uint32_t a[4], b[2];
    float c[4];
};

enum Elem { BF16, F16, E4M3, E5M2 };

inline float element(const MmaLane* const lanes[32], const Holder& w, bool is_a, Elem kind) {
    const uint32_t reg = is_a ? lanes[w.lane]->a[w.reg] : lanes[w.lane]->b[w.reg];
    switch (kind) {
        case BF16: return bf16_to_f32((reg >> (16 * w.part)) & 0xffffu);
        case F16: return f16_to_f32((reg >> (16 * w.part)) & 0xffffu);
        case E4M3: return e4m3_to_f32((reg >> (8 * w.part)) & 0xffu);
        default: return e5m2_to_f32((reg >> (8 * w.part)) & 0xffu);
    }
}

// D = A * B + C for the calling lane's four elements; every lane of the warp has posted its MmaLane.
inline void mma_lane(Thread* t, Elem kind, float d[4]) {
    const MmaLane* lanes[32];
    for (int l = 0; l < 32; ++l) lanes[l] = reinterpret_cast<const MmaLane*>(lane_thread(t, l)->slot);
    const int lane = lane_of(t), g = lane / 4, tq = lane % 4;
    const bool wide = kind == BF16 || kind == F16;
    const int K = wide ? 16 : 32;
    const Layout& L = layout();
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i / 2), col = 2 * tq + i % 2;
        float acc = lanes[lane]->c[i];
        for (int k = 0; k < K; ++k) {
            const float a = element(lanes, wide ? L.a16[row][k] : L.a8[row][k], true, kind);
            const float b = element(lanes, wide ? L.b16[k][col] : L.b8[k][col], false, kind);
            acc = acc + a * b;
        }
        d[i] = acc;
    }
}

// ---- shared-memory addresses (ldmatrix) -------------------------------------------------------
// __cvta_generic_to_shared maps the launch's dynamic shared memory to [kSharedBase, ..), a
// 32-bit window like the GPU's shared state space; static __shared__ arrays are not mapped.
constexpr uint32_t kSharedBase = 0x01000000u;

inline unsigned char* shared_pointer(uint64_t addr, int bytes) {
    const uint64_t n = g->dyn_smem.size() - kCanary;
    if (addr < kSharedBase || addr + bytes > kSharedBase + n) {
        fail("a shared-memory address outside the dynamic shared memory (cusim maps only dynamic shared memory)");
        return nullptr;
    }
    return g->dyn_smem.data() + (addr - kSharedBase);
}

// ---- the interpreter ---------------------------------------------------------------------------
enum { OP_MMA = 20, OP_LDMATRIX };

struct Statement {
    std::string name;
    std::vector<std::vector<std::string>> groups;   // {a, b}, [a] and a: one group each
};

inline std::string trim(const std::string& s) {
    const size_t a = s.find_first_not_of(" \t\r\n"), b = s.find_last_not_of(" \t\r\n");
    return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

inline std::vector<Statement> parse_ptx(const std::string& text) {
    std::vector<Statement> out;
    size_t start = 0;
    while (start < text.size()) {
        size_t end = text.find(';', start);
        if (end == std::string::npos) end = text.size();
        const std::string stmt = trim(text.substr(start, end - start));
        start = end + 1;
        if (stmt.empty()) continue;
        Statement s;
        const size_t sp = stmt.find_first_of(" \t");
        s.name = stmt.substr(0, sp);
        std::string rest = sp == std::string::npos ? "" : stmt.substr(sp);
        std::vector<std::string> cur;
        std::string tok;
        int depth = 0;
        auto flush = [&]() {
            const std::string t = trim(tok);
            if (!t.empty()) cur.push_back(t);
            tok.clear();
        };
        for (char c : rest) {
            if (c == '{' || c == '[') { ++depth; continue; }
            if (c == '}' || c == ']') { --depth; continue; }
            if (c == ',' && depth > 0) { flush(); continue; }
            if (c == ',' && depth == 0) { flush(); s.groups.push_back(cur); cur.clear(); continue; }
            tok += c;
        }
        flush();
        if (!cur.empty()) s.groups.push_back(cur);
        out.push_back(s);
    }
    return out;
}

// operand "%n" -> its index; an immediate (0f3f800000, 12) -> -1 with its bits in *imm
inline int operand_index(const std::string& tok, uint64_t* imm) {
    if (!tok.empty() && tok[0] == '%') return std::atoi(tok.c_str() + 1);
    if (tok.size() > 2 && tok[0] == '0' && (tok[1] == 'f' || tok[1] == 'F')) *imm = std::strtoull(tok.c_str() + 2, nullptr, 16);
    else *imm = std::strtoull(tok.c_str(), nullptr, 0);
    return -1;
}

struct Operands {
    std::vector<PtxOperand> ops;
    bool ok = true;
    uint64_t get(const std::string& tok) {
        uint64_t imm = 0;
        const int i = operand_index(tok, &imm);
        if (i < 0) return imm;
        if (i >= (int)ops.size()) { fail("an inline PTX operand number is out of range: " + tok); ok = false; return 0; }
        return ops[i].bits;
    }
    void set(const std::string& tok, uint64_t bits) {
        uint64_t imm = 0;
        const int i = operand_index(tok, &imm);
        if (i < 0 || i >= (int)ops.size()) { fail("an inline PTX destination is not an operand: " + tok); ok = false; return; }
        ptx_write(ops[i], bits);
        ops[i].bits = bits;   // a later statement of the same asm reads the new value
    }
};

inline bool has(const std::string& name, const char* part) { return name.find(part) != std::string::npos; }

inline void run_mma(const Statement& s, Operands& o) {
    Elem kind;
    if (has(s.name, ".m16n8k16.row.col.f32.bf16.bf16.f32")) kind = BF16;
    else if (has(s.name, ".m16n8k16.row.col.f32.f16.f16.f32")) kind = F16;
    else if (has(s.name, ".m16n8k32.row.col.f32.e4m3.e4m3.f32")) kind = E4M3;
    else if (has(s.name, ".m16n8k32.row.col.f32.e5m2.e5m2.f32")) kind = E5M2;
    else { fail("cusim does not simulate " + s.name); return; }
    if (s.name.rfind("mma.sync.aligned.", 0) != 0) { fail("cusim simulates only mma.sync.aligned: " + s.name); return; }
    if ((kind == E4M3 || kind == E5M2) && __CUDA_ARCH__ < 890) { fail(s.name + " needs sm_89 or later"); return; }
    if (s.groups.size() != 4 || s.groups[0].size() != 4 || s.groups[1].size() != 4 || s.groups[2].size() != 2 ||
        s.groups[3].size() != 4) {
        fail("mma operands must be {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3}: " + s.name);
        return;
    }
    MmaLane mine;
    for (int i = 0; i < 4; ++i) mine.a[i] = (uint32_t)o.get(s.groups[1][i]);
    for (int i = 0; i < 2; ++i) mine.b[i] = (uint32_t)o.get(s.groups[2][i]);
    for (int i = 0; i < 4; ++i) mine.c[i] = from_bits<float>(o.get(s.groups[3][i]));
    if (!o.ok) return;
    float d[4];
    warp_collective(0xffffffffu, OP_MMA, (uint64_t)(uintptr_t)&mine, [&](Thread* t) {
        mma_lane(t, kind, d);
        return (uint64_t)0;
    });
    for (int i = 0; i < 4; ++i) o.set(s.groups[0][i], bits_of(d[i]));
}

inline void run_ldmatrix(const Statement& s, Operands& o) {
    const bool trans = has(s.name, ".trans");
    const int n = has(s.name, ".x4") ? 4 : has(s.name, ".x2") ? 2 : has(s.name, ".x1") ? 1 : 0;
    if (!n || !has(s.name, ".m8n8") || !has(s.name, ".shared") || !has(s.name, ".b16") ||
        s.name.rfind("ldmatrix.sync.aligned.", 0) != 0) {
        fail("cusim does not simulate " + s.name);
        return;
    }
    if (s.groups.size() != 2 || (int)s.groups[0].size() != n || s.groups[1].size() != 1) {
        fail("ldmatrix operands must be {r0..r" + std::to_string(n - 1) + "}, [address]: " + s.name);
        return;
    }
    const uint64_t addr = (uint32_t)o.get(s.groups[1][0]);
    if (addr % 16) { fail("ldmatrix row address is not 16-byte aligned"); return; }
    uint32_t r[4] = {0, 0, 0, 0};
    warp_collective(0xffffffffu, OP_LDMATRIX, addr, [&](Thread* t) {
        const int lane = lane_of(t), g = lane / 4, q = lane % 4;
        for (int m = 0; m < n; ++m) {
            if (!trans) {   // r_m = row g of matrix m, columns 2q, 2q + 1
                unsigned char* p = shared_pointer(lane_thread(t, 8 * m + g)->slot, 16);
                if (p) std::memcpy(&r[m], p + 4 * q, 4);
            } else {   // transposed: r_m = column g, rows 2q (low half) and 2q + 1
                unsigned char* p0 = shared_pointer(lane_thread(t, 8 * m + 2 * q)->slot, 16);
                unsigned char* p1 = shared_pointer(lane_thread(t, 8 * m + 2 * q + 1)->slot, 16);
                uint16_t lo = 0, hi = 0;
                if (p0) std::memcpy(&lo, p0 + 2 * g, 2);
                if (p1) std::memcpy(&hi, p1 + 2 * g, 2);
                r[m] = (uint32_t)lo | ((uint32_t)hi << 16);
            }
        }
        return (uint64_t)0;
    });
    for (int m = 0; m < n; ++m) o.set(s.groups[0][m], r[m]);
}

inline void run_cvt(const Statement& s, Operands& o) {
    const bool e4m3 = s.name == "cvt.rn.f16x2.e4m3x2";
    if (!e4m3 && s.name != "cvt.rn.f16x2.e5m2x2") { fail("cusim does not simulate " + s.name); return; }
    if (__CUDA_ARCH__ < 890) { fail(s.name + " needs sm_89 or later"); return; }
    if (s.groups.size() != 2) { fail("cvt takes d, a: " + s.name); return; }
    const uint32_t a = (uint32_t)o.get(s.groups[1][0]);
    uint32_t d = 0;
    for (int i = 0; i < 2; ++i) {
        const uint32_t byte = (a >> (8 * i)) & 0xffu;
        const uint32_t h = e4m3 ? f32_to_f16_exact(e4m3_to_f32(byte)) : byte << 8;
        d |= h << (16 * i);
    }
    o.set(s.groups[0][0], d);
}

inline void run_cp_async(const Statement& s, Operands& o) {
    Thread* t = g->cur;
    if (s.name == "cp.async.commit_group") {
        ++t->committed;
        for (AsyncCopy& c : t->copies)
            if (c.group < 0) c.group = t->committed;
        return;
    }
    if (s.name == "cp.async.wait_group" || s.name == "cp.async.wait_all") {
        if (s.name == "cp.async.wait_all") run_cp_async(Statement{"cp.async.commit_group", {}}, o);
        const int keep = s.name == "cp.async.wait_all" ? 0 : (s.groups.size() == 1 ? (int)o.get(s.groups[0][0]) : -1);
        if (keep < 0) { fail("cp.async.wait_group takes one immediate"); return; }
        std::vector<AsyncCopy> rest;
        for (const AsyncCopy& c : t->copies) {
            if (c.group < 0 || c.group > t->committed - keep) { rest.push_back(c); continue; }
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset(c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
        }
        t->copies.swap(rest);
        return;
    }
    const bool cg = s.name == "cp.async.cg.shared.global", ca = s.name == "cp.async.ca.shared.global";
    if ((!cg && !ca) || (s.groups.size() != 3 && s.groups.size() != 4)) { fail("cusim does not simulate " + s.name); return; }
    const int bytes = (int)o.get(s.groups[2][0]);
    const int src_bytes = s.groups.size() == 4 ? (int)o.get(s.groups[3][0]) : bytes;
    if (!(bytes == 16 || (ca && (bytes == 4 || bytes == 8))) || src_bytes < 0 || src_bytes > bytes) {
        fail("cp.async copies 4, 8 or 16 bytes (.cg: 16), src_size at most that: " + s.name);
        return;
    }
    const uint64_t dst = (uint32_t)o.get(s.groups[0][0]), src = o.get(s.groups[1][0]);
    if (dst % bytes || src % bytes) { fail("cp.async addresses must be aligned to the copy size"); return; }
    unsigned char* d = shared_pointer(dst, bytes);
    if (!d) return;
    if (g->async_eager) {
        std::memcpy(d, reinterpret_cast<const unsigned char*>(src), src_bytes);
        std::memset(d + src_bytes, 0, bytes - src_bytes);
    } else {
        t->copies.push_back(AsyncCopy{d, reinterpret_cast<const unsigned char*>(src), bytes, src_bytes, -1});
    }
}

inline void ptx(const char* text, std::initializer_list<PtxOperand> outs, std::initializer_list<PtxOperand> ins) {
    Operands o;
    o.ops.assign(outs.begin(), outs.end());
    o.ops.insert(o.ops.end(), ins.begin(), ins.end());
    for (const Statement& s : parse_ptx(text)) {
        if (s.name.rfind("mma.", 0) == 0) run_mma(s, o);
        else if (s.name.rfind("ldmatrix.", 0) == 0) run_ldmatrix(s, o);
        else if (s.name.rfind("cvt.", 0) == 0) run_cvt(s, o);
        else if (s.name.rfind("cp.async.", 0) == 0) run_cp_async(s, o);
        else if (s.name == "mov.b32" || s.name == "mov.u32" || s.name == "mov.f32") {
            if (s.groups.size() == 2) o.set(s.groups[0][0], o.get(s.groups[1][0]) & 0xffffffffu);
            else fail("mov takes d, a");
        } else fail("cusim does not simulate the inline PTX instruction `" + s.name + "`");
        if (!g->error.empty()) return;
    }
}

}  // namespace cusim

inline size_t __cvta_generic_to_shared(const void* p) {
    const unsigned char* c = static_cast<const unsigned char*>(p);
    const unsigned char* base = cusim::g->dyn_smem.data();
    const size_t n = cusim::g->dyn_smem.size() - cusim::kCanary;
    if (c < base || c > base + n) {
        cusim::fail("__cvta_generic_to_shared: not a pointer into the dynamic shared memory (the only shared "
                    "memory cusim gives addresses)");
        return 0;
    }
    return cusim::kSharedBase + (size_t)(c - base);
}
