// The CPU executor's scheduler (engine/exercises/cuda_cpu): runs a kernel's grid on one OS thread.
//
// Blocks run one after another. The threads of a block are fibers, each with its own stack: a
// fiber runs until it reaches __syncthreads(), a warp shuffle or vote, or the end of the kernel,
// then the next runnable fiber runs. __syncthreads() releases the block when every thread that has
// not returned has reached it; a warp operation completes when the lanes its mask names have all
// reached one (the values are exchanged then, as the hardware would). A block whose threads all
// wait and none can go on is reported as a deadlock, never waited on.
//
// The order in which fibers (and blocks) take turns is the launch's `schedule`: 0 in order, 1 in
// reverse, 2 shuffled anew at every turn. A kernel without a race gives the same bits under all
// three; one that reads shared memory another thread writes without a barrier between them does
// not, which is how the checker's "results change from one launch to the next" shows on a CPU.
//
// Fibers start with makecontext and switch with _setjmp/_longjmp (no signal-mask system call per
// switch: a paged-attention case takes millions of switches). A fault (a read or write outside the
// buffers, which sit between inaccessible pages) is reported with the block, the thread and the
// argument whose buffer the address missed.
#undef _FORTIFY_SOURCE          // its longjmp check rejects jumps between stacks, which is all fibers do
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700       // ucontext on macOS
#endif
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_cpu.h"

extern "C" {
uint3 cudacpu_threadIdx, cudacpu_blockIdx;
dim3 cudacpu_blockDim, cudacpu_gridDim;
void cudacpu_entry(void** args);      // the launcher appended to the kernel's source defines it
}

// __start_/__stop_ of the __shared__ variables' section (an ELF linker defines them when it exists)
#if defined(__ELF__)
extern "C" char __start_cudacpu_shared[] __attribute__((weak));
extern "C" char __stop_cudacpu_shared[] __attribute__((weak));
static char* shared_begin() { return __start_cudacpu_shared; }
static char* shared_end() { return __stop_cudacpu_shared; }
#else
static char* shared_begin() { return nullptr; }
static char* shared_end() { return nullptr; }
#endif

namespace {

enum State { RUNNABLE, AT_BARRIER, AT_WARP, FINISHED };

struct Fiber {
    jmp_buf jb;
    ucontext_t uc;
    char* map = nullptr;                  // guard page + stack
    int state = RUNNABLE;
    bool started = false;
    uint3 tid{};
    unsigned linear = 0;                  // x + y * Dx + z * Dx * Dy: lane = linear % 32
    int op = 0, arg = 0, width = 32, pred = 0, result = 0;
    unsigned mask = 0;
    unsigned long long in = 0, out = 0;
};

constexpr size_t STACK_BYTES = 256 * 1024;
size_t g_page = 4096;
std::vector<Fiber> g_fibers;
Fiber* g_cur = nullptr;
jmp_buf g_sched;
void** g_args = nullptr;
int g_finished = 0, g_at_barrier = 0;
char g_message[2048];
int g_failed = 0;                         // a launch error found inside a fiber (mismatched warp operations)

struct Range { uintptr_t lo, hi; };
std::vector<Range> g_ranges;              // the buffer of each pointer argument (lo == hi: not a pointer)

const char* op_name(int op) {
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__ballot_sync/__any_sync/__all_sync", "__syncwarp", "__reduce_add_sync",
                                  "__reduce_min_sync", "__reduce_max_sync"};
    return op >= 0 && op < 9 ? names[op] : "a warp operation";
}

void yield_to_scheduler() {
    if (!_setjmp(g_cur->jb)) _longjmp(g_sched, 1);
}

void fiber_main() {
    for (;;) {                            // one kernel call per block; the fiber is reused by the next block
        cudacpu_entry(g_args);
        g_cur->state = FINISHED;
        yield_to_scheduler();
    }
}

void resume(Fiber& f) {
    g_cur = &f;
    cudacpu_threadIdx = f.tid;
    if (!_setjmp(g_sched)) {
        if (!f.started) {
            f.started = true;
            setcontext(&f.uc);
        }
        _longjmp(f.jb, 1);
    }
}

void release_barrier() {
    int count = 0, all = 1, any = 0;
    for (Fiber& f : g_fibers)
        if (f.state == AT_BARRIER) { count += f.pred; all &= f.pred; any |= f.pred; }
    for (Fiber& f : g_fibers)
        if (f.state == AT_BARRIER) {
            f.result = f.op == 1 ? count : f.op == 2 ? all : f.op == 3 ? any : 0;
            f.state = RUNNABLE;
        }
    g_at_barrier = 0;
}

// Complete warp w's operation if every lane its mask names has reached one.
void try_complete_warp(unsigned w, unsigned mask) {
    const unsigned n = (unsigned)g_fibers.size(), base = w * 32, lanes = std::min(32u, n - base);
    unsigned required = 0;
    for (unsigned l = 0; l < lanes; ++l)
        if (mask >> l & 1u) {
            if (g_fibers[base + l].state != AT_WARP) return;
            required |= 1u << l;
        }
    const int op = g_cur->op;
    for (unsigned l = 0; l < lanes; ++l)
        if ((required >> l & 1u) && g_fibers[base + l].op != op) {
            snprintf(g_message, sizeof g_message,
                     "warp %u of block (%u,%u,%u): lane %u reached %s while lane %u reached %s: the lanes of a warp "
                     "must meet at the same warp operation", w, cudacpu_blockIdx.x, cudacpu_blockIdx.y,
                     cudacpu_blockIdx.z, (unsigned)(g_cur->linear % 32), op_name(op), l, op_name(g_fibers[base + l].op));
            g_failed = 1;
            return;
        }
    unsigned long long ballot = 0, sum = 0, lo = ~0ull, hi = 0;
    for (unsigned l = 0; l < lanes; ++l)
        if (required >> l & 1u) {
            const unsigned long long v = g_fibers[base + l].in;
            if (v) ballot |= 1ull << l;
            sum += (unsigned)v; lo = std::min(lo, v); hi = std::max(hi, v);
        }
    for (unsigned l = 0; l < lanes; ++l) {
        if (!(required >> l & 1u)) continue;
        Fiber& f = g_fibers[base + l];
        const int width = (f.width >= 1 && f.width <= 32 && !(f.width & (f.width - 1))) ? f.width : 32;
        const unsigned seg = l & ~(unsigned)(width - 1), in_seg = l - seg;
        long src = l;
        switch (f.op) {
            case CUDACPU_SHFL: src = seg + ((unsigned)f.arg & (unsigned)(width - 1)); break;
            case CUDACPU_SHFL_UP: src = in_seg >= (unsigned)f.arg ? (long)l - f.arg : l; break;
            case CUDACPU_SHFL_DOWN: src = in_seg + (unsigned)f.arg < (unsigned)width ? (long)l + f.arg : l; break;
            case CUDACPU_SHFL_XOR: src = l ^ (unsigned)f.arg; if ((unsigned)src >= seg + width) src = l; break;
        }
        if (src < 0 || src >= (long)lanes || !(required >> src & 1u)) src = l;   // not a participating lane: own value
        switch (f.op) {
            case CUDACPU_BALLOT: f.out = ballot; break;
            case CUDACPU_SYNCWARP: f.out = 0; break;
            case CUDACPU_REDUCE_ADD: f.out = (unsigned)sum; break;
            case CUDACPU_REDUCE_MIN: f.out = lo; break;
            case CUDACPU_REDUCE_MAX: f.out = hi; break;
            default: f.out = g_fibers[base + src].in;
        }
    }
    for (unsigned l = 0; l < lanes; ++l)
        if (required >> l & 1u) g_fibers[base + l].state = RUNNABLE;
}

void describe_deadlock() {
    int at_barrier = 0, at_warp = 0, finished = 0;
    const Fiber* waiting = nullptr;
    for (const Fiber& f : g_fibers) {
        at_barrier += f.state == AT_BARRIER;
        finished += f.state == FINISHED;
        if (f.state == AT_WARP) { at_warp++; if (!waiting) waiting = &f; }
    }
    int pos = snprintf(g_message, sizeof g_message,
                       "block (%u,%u,%u) can never finish: %d thread(s) wait at __syncthreads(), %d at a warp operation, "
                       "%d returned", cudacpu_blockIdx.x, cudacpu_blockIdx.y, cudacpu_blockIdx.z, at_barrier, at_warp,
                       finished);
    if (waiting) {
        const unsigned base = waiting->linear / 32 * 32;
        unsigned missing = 0;
        for (unsigned l = 0; l < 32 && base + l < g_fibers.size(); ++l)
            if ((waiting->mask >> l & 1u) && g_fibers[base + l].state != AT_WARP) { missing = l; break; }
        const Fiber& m = g_fibers[base + missing];
        snprintf(g_message + pos, sizeof g_message - pos,
                 ". Thread (%u,%u,%u) waits at %s for lane %u of its warp, which %s: every lane a shuffle's mask names "
                 "must reach it (0xffffffff: all 32)", waiting->tid.x, waiting->tid.y, waiting->tid.z, op_name(waiting->op),
                 missing, m.state == FINISHED ? "returned before reaching it" : "waits at __syncthreads()");
    } else {
        snprintf(g_message + pos, sizeof g_message - pos,
                 ": a __syncthreads() that not every thread reaches (inside a branch or a loop whose trip count differs "
                 "between threads) never opens");
    }
}

// ----------------------------------------------------------------------------- faults
stack_t g_altstack;

void put(const char* s) { ssize_t r = write(2, s, strlen(s)); (void)r; }

void on_fault(int sig, siginfo_t* info, void* context) {
    char msg[1024];
    const uintptr_t a = (uintptr_t)info->si_addr;
    const char* access = "an access";
#if defined(__linux__) && defined(__x86_64__)
    // the page fault's error code: bit 1 set = the faulting access was a write
    access = (((const ucontext_t*)context)->uc_mcontext.gregs[REG_ERR] & 2) ? "a write" : "a read";
#else
    (void)context;
#endif
    int pos = 0;
    if (g_cur)
        pos = snprintf(msg, sizeof msg, "CUDACPU fault: block (%u,%u,%u), thread (%u,%u,%u): ", cudacpu_blockIdx.x,
                       cudacpu_blockIdx.y, cudacpu_blockIdx.z, g_cur->tid.x, g_cur->tid.y, g_cur->tid.z);
    else
        pos = snprintf(msg, sizeof msg, "CUDACPU fault: outside the kernel: ");
    if (sig == SIGFPE) {
        snprintf(msg + pos, sizeof msg - pos, "an integer division by zero (or %% 0)\n");
    } else if (sig == SIGILL || sig == SIGTRAP) {
        snprintf(msg + pos, sizeof msg - pos, "an illegal instruction (a function that returns no value, or __trap)\n");
    } else {
        const char* what = nullptr;
        long best = -1;
        size_t arg = 0;
        bool after = true;
        for (size_t i = 0; i < g_ranges.size(); ++i) {
            const Range& r = g_ranges[i];
            if (r.lo == r.hi) continue;
            if (a >= r.hi && (best < 0 || (long)(a - r.hi) < best)) { best = (long)(a - r.hi); arg = i; after = true; }
            if (a < r.lo && (best < 0 || (long)(r.lo - a) < best)) { best = (long)(r.lo - a); arg = i; after = false; }
        }
        for (const Fiber& f : g_fibers)
            if (f.map && a >= (uintptr_t)f.map && a < (uintptr_t)f.map + g_page) what = "stack";
        if (what)
            snprintf(msg + pos, sizeof msg - pos, "a stack overflow (the thread's local variables exceed %zu KiB: "
                     "a large local array?)\n", STACK_BYTES / 1024);
        else if (a < 65536)
            snprintf(msg + pos, sizeof msg - pos, "%s at address %#lx, near NULL (a null pointer)\n", access, (unsigned long)a);
        else if (best >= 0 && best < (1L << 30))
            snprintf(msg + pos, sizeof msg - pos, "%s %ld bytes %s argument %zu\n", access,
                     after ? best + 1 : best, after ? "past the end of" : "before the start of", arg + 1);
        else
            snprintf(msg + pos, sizeof msg - pos, "%s at address %#lx, outside every buffer\n", access, (unsigned long)a);
    }
    fflush(stdout);
    put(msg);
    _exit(70);
}

void install_fault_handlers() {
    static bool done = false;
    if (done) return;
    done = true;
    g_page = (size_t)sysconf(_SC_PAGESIZE);
    g_altstack.ss_size = 64 * 1024;
    g_altstack.ss_sp = malloc(g_altstack.ss_size);
    g_altstack.ss_flags = 0;
    sigaltstack(&g_altstack, nullptr);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP}) sigaction(sig, &sa, nullptr);
}

bool make_fibers(unsigned n, const dim3& block) {
    g_fibers.assign(n, Fiber());
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = g_fibers[i];
        f.linear = i;
        f.tid = {i % block.x, i / block.x % block.y, i / (block.x * block.y)};
        void* m = mmap(nullptr, STACK_BYTES + g_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS
#ifdef MAP_NORESERVE
                       | MAP_NORESERVE
#endif
                       , -1, 0);
        if (m == MAP_FAILED) return false;
        f.map = (char*)m;
        mprotect(f.map, g_page, PROT_NONE);          // the stack grows down into this page: an overflow faults
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = f.map + g_page;
        f.uc.uc_stack.ss_size = STACK_BYTES;
        f.uc.uc_link = nullptr;
        makecontext(&f.uc, fiber_main, 0);
    }
    return true;
}

void free_fibers() {
    for (Fiber& f : g_fibers)
        if (f.map) munmap(f.map, STACK_BYTES + g_page);
    g_fibers.clear();
    g_cur = nullptr;
}

}  // namespace

extern "C" {

int cudacpu_barrier(int op, int predicate) {
    Fiber& f = *g_cur;
    f.op = op;
    f.pred = predicate;
    f.state = AT_BARRIER;
    if (++g_at_barrier + g_finished == (int)g_fibers.size()) release_barrier();   // the last one opens it
    else yield_to_scheduler();
    return f.result;
}

unsigned long long cudacpu_warp(int op, unsigned mask, unsigned long long bits, int arg, int width) {
    Fiber& f = *g_cur;
    f.op = op;
    f.mask = mask;
    f.in = bits;
    f.arg = arg;
    f.width = width;
    f.state = AT_WARP;
    if (!(mask >> (f.linear % 32) & 1u)) {
        snprintf(g_message, sizeof g_message, "thread (%u,%u,%u) called %s with a mask (%#x) that leaves out its own lane %u",
                 f.tid.x, f.tid.y, f.tid.z, op_name(op), mask, f.linear % 32);
        g_failed = 1;
    } else {
        try_complete_warp(f.linear / 32, mask);
    }
    while (f.state == AT_WARP && !g_failed) yield_to_scheduler();
    if (g_failed) yield_to_scheduler();   // the scheduler stops the launch
    return f.out;
}

void cudacpu_trap(const char* what) {
    fflush(stdout);
    put("CUDACPU trap: ");
    put(what);
    put("\n");
    _exit(71);
}

// Run the grid. args[i] points at argument i; ranges[2i], ranges[2i+1] are the bytes of the buffer a
// pointer argument points into (equal for a scalar). 0 = done, else message holds what went wrong.
__attribute__((visibility("default")))
int cudacpu_launch(const unsigned* grid, const unsigned* block, void** args, int schedule,
                   const unsigned long long* ranges, int nargs, char* message, int message_size) {
    install_fault_handlers();
    g_ranges.assign(nargs, Range{0, 0});
    for (int i = 0; i < nargs; ++i) g_ranges[i] = Range{(uintptr_t)ranges[2 * i], (uintptr_t)ranges[2 * i + 1]};
    const dim3 gd(grid[0], grid[1], grid[2]), bd(block[0], block[1], block[2]);
    const unsigned long long threads = (unsigned long long)bd.x * bd.y * bd.z;
    const unsigned long long blocks = (unsigned long long)gd.x * gd.y * gd.z;
    if (threads == 0 || blocks == 0 || threads > 1024 || bd.z > 64 || gd.y > 65535 || gd.z > 65535) {
        snprintf(message, message_size, "invalid launch: grid (%u,%u,%u), block (%u,%u,%u) (a block holds 1 to 1024 "
                 "threads, block.z <= 64, grid.y and grid.z <= 65535)", gd.x, gd.y, gd.z, bd.x, bd.y, bd.z);
        return 3;
    }
    cudacpu_gridDim = gd;
    cudacpu_blockDim = bd;
    g_args = args;
    g_failed = 0;
    if (!make_fibers((unsigned)threads, bd)) {
        free_fibers();
        snprintf(message, message_size, "out of memory for %llu thread stacks", threads);
        return 4;
    }
    std::mt19937 rng(12345u + (unsigned)schedule);
    std::vector<unsigned long long> block_order(blocks);
    for (unsigned long long b = 0; b < blocks; ++b) block_order[b] = b;
    if (schedule == 1) std::reverse(block_order.begin(), block_order.end());
    if (schedule == 2) std::shuffle(block_order.begin(), block_order.end(), rng);
    std::vector<unsigned> order(threads);
    char* const shared = shared_begin();
    const size_t shared_bytes = shared ? (size_t)(shared_end() - shared) : 0;
    int status = 0;
    for (unsigned long long b : block_order) {
        cudacpu_blockIdx = {(unsigned)(b % gd.x), (unsigned)(b / gd.x % gd.y), (unsigned)(b / ((unsigned long long)gd.x * gd.y))};
        if (shared_bytes) memset(shared, 0xFF, shared_bytes);
        for (unsigned i = 0; i < threads; ++i) { order[i] = i; g_fibers[i].state = RUNNABLE; }
        if (schedule == 1) std::reverse(order.begin(), order.end());
        g_finished = 0;
        g_at_barrier = 0;
        while (g_finished < (int)threads) {
            bool ran = false;
            if (schedule == 2) std::shuffle(order.begin(), order.end(), rng);
            for (unsigned i : order) {
                Fiber& f = g_fibers[i];
                if (f.state != RUNNABLE) continue;
                ran = true;
                resume(f);
                if (g_failed) break;
                if (f.state == FINISHED && ++g_finished + g_at_barrier == (int)threads && g_at_barrier) release_barrier();
            }
            if (g_failed) { status = 2; break; }
            if (!ran) { describe_deadlock(); status = 2; break; }
        }
        if (status) break;
    }
    if (status) snprintf(message, message_size, "%s", g_message);
    free_fibers();
    fflush(stdout);
    return status;
}

}  // extern "C"
