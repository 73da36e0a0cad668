"""C++ source of the work split the GGUF matmuls use inside an OpenMP team (``team_for``),
composed into kvmesh.model.gguf_native's extension before the kernels that call it (the one-row
path, kvmesh.model.gguf_rows1, and the blocked path, kvmesh.model.gguf_blocked).

NOTE. A decode step's matmuls are split over the team, and every matmul ends in a barrier. With a
static split (``omp for schedule(static)``) each thread gets the same number of weight rows, but
not the same time: the two threads of the 2-core Ice Lake share its memory bandwidth unevenly from
call to call. Measured per barrier there (one-off, cycle counters around each barrier in a
SmolLM2-135M decode step, ~10.4 ms): ~0.8 ms a step of one thread waiting for the other, mostly
at the gate/up and down matmuls. A dynamic schedule (chunks handed out in order) was slower: a
thread's rows are no longer consecutive, so the 4 KB prefetch runs ahead into rows another
thread takes.
Here each thread owns its static range and walks it front to back in chunks, as before; a thread
done with its own range takes chunks from the back of the others', so only the last few chunks
move. A range is one 64-bit word (call number, front, back) in a slot of the team's own array,
claimed by compare-and-swap, so a chunk goes to exactly one thread. Where each output is
computed does not change how: every row's bits are the same whoever computes it (tested).
Measured (one-off, paired A/B in one process against the static split, every step run by both
builds in turn): a one-row decode step 0.17-0.28 ms faster (of ~10.6 ms; median and mean of ~430
pairs), a 32-row step 12-21 ms faster (of ~120-141 ms, two runs), 8 rows unchanged; the same bits.

``gguf_team_probe`` (a test hook) runs team_for over n items in a team of two whose thread 0,
its range published, claims nothing until thread 1 has taken a chunk of it (or has stopped
claiming, so a broken steal fails the test instead of hanging it); it returns who did each item.

A team that wants this declares a ``TeamSlots`` before its ``omp parallel`` and calls
``team_begin(&team)`` first thing inside it, on every thread; ``team_for`` called outside such a
region (another caller's team, or no team) splits statically as ``omp for`` does.
"""

TEAM_SOURCE = r"""
// ---- Static ranges with stealing from their backs (see kvmesh.model.gguf_team) ----
#include <atomic>
#include <thread>
constexpr int TEAM_MAX = 64;
struct alignas(64) TeamSlot { std::atomic<uint64_t> v{0}; };
struct TeamSlots { TeamSlot slot[TEAM_MAX]; };
static thread_local TeamSlots* t_team = nullptr;   // the region's slots, set by team_begin
static thread_local uint64_t t_team_calls = 0;      // team_for calls in this region so far

// Every thread of a region, first thing: its team's slots (declared before the region, shared).
static inline void team_begin(TeamSlots* slots) {
  t_team = slots;
  t_team_calls = 0;
}
static inline void team_end() { t_team = nullptr; }

static inline uint64_t team_pack(uint64_t call, int64_t front, int64_t back) {
  return (call << 48) | ((uint64_t)front << 24) | (uint64_t)back;
}

// Claims [lo, hi) of at most `chunk` items: from the front of my range, then from the backs of
// the others' (victim walks me + 1, me + 2, ... around the team). False when nothing is left.
static inline bool team_claim(TeamSlots* ts, int me, int nt, uint64_t call, int64_t chunk, int& victim,
                              int64_t& lo, int64_t& hi) {
  for (;;) {
    std::atomic<uint64_t>& word = ts->slot[victim < 0 ? me : victim].v;
    uint64_t v = word.load(std::memory_order_acquire);
    for (;;) {
      const int64_t f = (int64_t)((v >> 24) & 0xFFFFFF), b = (int64_t)(v & 0xFFFFFF);
      if ((v >> 48) != call || f >= b) break;  // not yet this call's range, or empty
      uint64_t nv;
      if (victim < 0) { lo = f; hi = std::min(f + chunk, b); nv = team_pack(call, hi, b); }
      else { hi = b; lo = std::max(b - chunk, f); nv = team_pack(call, f, lo); }
      if (word.compare_exchange_weak(v, nv, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
    }
    victim = ((victim < 0 ? me : victim) + 1) % nt;  // this range is done: the next one
    if (victim == me) return false;
  }
}

struct NoHold { void operator()(bool) const {} };

// body(lo, hi) over [0, n) split across the calling team, then a barrier (as `omp for`); `hold`
// runs on each thread with false once its range is published, before it claims, and with true
// once it has nothing left to claim (the test hook's pause and its release).
template <class Body, class Hold = NoHold>
static void team_for(int64_t n, int64_t chunk, Body&& body, Hold hold = Hold()) {
  const int nt = omp_get_num_threads(), me = omp_get_thread_num();
  TeamSlots* ts = t_team;
  if (ts == nullptr || nt > TEAM_MAX || n >= ((int64_t)1 << 24)) {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i, i + 1);
    return;
  }
  const uint64_t call = ++t_team_calls & 0xFFFF;
  ts->slot[me].v.store(team_pack(call, n * me / nt, n * (me + 1) / nt), std::memory_order_release);
  hold(false);
  int victim = -1;
  int64_t lo = 0, hi = 0;
  while (team_claim(ts, me, nt, call, chunk, victim, lo, hi)) body(lo, hi);
  hold(true);
  #pragma omp barrier
}

// Test hook: team_for over n items (chunks of `chunk`) in a team of two; thread 0 claims nothing
// until thread 1 has stolen from it or has nothing left to claim (thread 1 starts once thread 0 has
// published; it ends its own range first, then steals unless stealing is broken). Returns
// [n] int64: for each item, 1 + the thread that did it, plus 100 per extra visit.
torch::Tensor gguf_team_probe(int64_t n, int64_t chunk) {
  TORCH_CHECK(n >= 2 && n < ((int64_t)1 << 24) && chunk >= 1, "gguf_team_probe: 2 <= n < 2^24, chunk >= 1");
  auto who = torch::zeros({n}, torch::kInt64);
  int64_t* w = who.data_ptr<int64_t>();
  std::vector<std::atomic<int64_t>> visits(n);
  std::atomic<int64_t> stolen{0}, published{0}, finished{0};
  TeamSlots team;
  #pragma omp parallel num_threads(2)
  {
    team_begin(&team);
    const int me = omp_get_thread_num();
    const bool two = omp_get_num_threads() == 2, pause = two && me == 0;
    team_for(n, chunk, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        if (visits[i].fetch_add(1) > 0) w[i] += 100;
        else w[i] += 1 + me;
        if (me == 1 && i < n / 2) stolen.store(1, std::memory_order_release);
      }
    }, [&](bool claimed_all) {
      if (claimed_all) {  // thread 1 is done claiming: thread 0 must not wait for a steal any more
        if (me == 1) finished.store(1, std::memory_order_release);
        return;
      }
      if (!pause) {  // thread 1: not before thread 0's range is there to steal from
        while (two && me == 1 && published.load(std::memory_order_acquire) == 0) std::this_thread::yield();
        return;
      }
      published.store(1, std::memory_order_release);
      while (stolen.load(std::memory_order_acquire) == 0 && finished.load(std::memory_order_acquire) == 0)
        std::this_thread::yield();
    });
    team_end();
  }
  return who;
}
"""
