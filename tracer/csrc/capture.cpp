// Megatrace native capture: a c10d Backend that wraps the real one (gloo, nccl, ...) and records every
// collective and point-to-point op that reaches it into the rank's ring file, whoever issued it.
//
// The issuing thread writes the record (one 72-byte slot of the mapped ring, layout of
// tracer/format.py) and queues the op's Work; completion is recorded by TracedWork::wait() for
// backends whose Work completes on the host (gloo), and otherwise by the completion thread, which
// polls Work::isCompleted() (on NCCL: a CUDA event query, never blocking a stream).
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include "ring_format.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace megatrace {

// The ring layout (constants, op and dtype codes, struct Record) comes from ring_format.h, generated
// from tracer/format.py at build time; the loader compares layout() with that Python definition.
constexpr size_t kMaxTracked = 65536;

inline int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

inline int64_t load(const int64_t* word) { return __atomic_load_n(word, __ATOMIC_RELAXED); }
inline void store(int64_t* word, int64_t value) { __atomic_store_n(word, value, __ATOMIC_RELAXED); }
inline void add(int64_t* word, int64_t value) { __atomic_fetch_add(word, value, __ATOMIC_RELAXED); }

uint8_t dtype_code(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return kDtypeFloat32;
    case c10::ScalarType::Half: return kDtypeFloat16;
    case c10::ScalarType::BFloat16: return kDtypeBfloat16;
    case c10::ScalarType::Double: return kDtypeFloat64;
    case c10::ScalarType::Char: return kDtypeInt8;
    case c10::ScalarType::Byte: return kDtypeUint8;
    case c10::ScalarType::Short: return kDtypeInt16;
    case c10::ScalarType::Int: return kDtypeInt32;
    case c10::ScalarType::Long: return kDtypeInt64;
    case c10::ScalarType::Bool: return kDtypeBool;
    case c10::ScalarType::Float8_e4m3fn: return kDtypeFloat8E4m3fn;
    case c10::ScalarType::Float8_e5m2: return kDtypeFloat8E5m2;
    case c10::ScalarType::ComplexFloat: return kDtypeComplex64;
    case c10::ScalarType::ComplexDouble: return kDtypeComplex128;
    default: return kDtypeOther;
  }
}

// The attached ring: this process's own mapping of the rank's file.
struct Ring {
  char* base = nullptr;
  size_t size = 0;
  int64_t* header = nullptr;
  Record* records = nullptr;
  int64_t capacity = 0;
  int32_t rank = -1;
  std::atomic<int64_t> serial{0};
  std::mutex comm_mutex;  // appending per-communicator counter entries
};

std::atomic<Ring*> g_ring{nullptr};
std::atomic<int64_t> g_users{0};  // threads inside the ring right now (detach waits for 0)

// Holds the ring for the duration of one record or completion; empty when no ring is attached.
class RingUse {
 public:
  RingUse() {
    g_users.fetch_add(1, std::memory_order_seq_cst);
    ring_ = g_ring.load(std::memory_order_seq_cst);
  }
  ~RingUse() { g_users.fetch_sub(1, std::memory_order_release); }
  Ring* get() const { return ring_; }

 private:
  Ring* ring_;
};

int64_t* comm_counters(Ring* ring, int slot) {
  return ring->header + kCommCountersOffset / 8 + slot * kCommCounterWords;
}

// The duration histogram of the communicator in counter entry `slot` (format.py: HISTOGRAM_*).
int64_t* histogram(Ring* ring, int slot) { return ring->header + kHistogramOffset / 8 + slot * kHistogramWords; }

// format.histogram_bucket: the duration's bit length less kHistogramFirstBits, within the buckets.
inline int histogram_bucket(int64_t duration_ns) {
  int bits = duration_ns > 0 ? 64 - __builtin_clzll(static_cast<uint64_t>(duration_ns)) : 0;
  return static_cast<int>(std::clamp<int64_t>(bits - kHistogramFirstBits, 0, kHistogramBuckets - 1));
}

// *word = max(*word, value), atomically (several threads complete ops of one communicator).
inline void raise_to(int64_t* word, int64_t value) {
  int64_t seen = load(word);
  while (value > seen && !__atomic_compare_exchange_n(word, &seen, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// Index of communicator `cid` in the header's counter table, appending it; -1 when the table is full.
int comm_slot(Ring* ring, int64_t cid) {
  std::lock_guard<std::mutex> guard(ring->comm_mutex);
  int64_t used = load(ring->header + kWCommCountersUsed);
  for (int slot = 0; slot < used; ++slot) {
    if (load(comm_counters(ring, slot) + kCId) == cid) return slot;
  }
  if (used >= kMaxCommCounters) return -1;
  int64_t* entry = comm_counters(ring, static_cast<int>(used));
  store(entry + kCId, cid);
  store(entry + kCInflightSeq, -1);
  store(ring->header + kWCommCountersUsed, used + 1);
  return static_cast<int>(used);
}

class TracedWork;

// The completion thread: polls queued Works, records completions, publishes the oldest op in flight.
class Completions {
 public:
  void add(c10::intrusive_ptr<TracedWork> work);
  void start();
  void stop();
  size_t tracked();
  int64_t passes() { return passes_.load(std::memory_order_relaxed); }

 private:
  void run();
  void pass();

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<c10::intrusive_ptr<TracedWork>> incoming_;
  std::vector<c10::intrusive_ptr<TracedWork>> polled_;
  std::atomic<size_t> polled_size_{0};  // polled_.size(), for add() to bound the queue
  std::atomic<int64_t> passes_{0};
  bool stop_ = false;
  std::thread thread_;
};

Completions& g_completions = *new Completions();  // never destroyed: its thread may outlive main()

// Storage of finished TracedWorks, reused: they are allocated on the issuing thread and mostly freed
// on the completion thread, where malloc would hand each one back to another thread's cache.
class WorkStorage {
 public:
  void* take(size_t size) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (!free_.empty()) {
        void* block = free_.back();
        free_.pop_back();
        return block;
      }
    }
    return ::operator new(size);
  }
  void give(void* block) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      if (free_.size() < kKept) {
        free_.push_back(block);
        return;
      }
    }
    ::operator delete(block);
  }

 private:
  static constexpr size_t kKept = 4096;
  std::mutex mutex_;
  std::vector<void*> free_;
};

WorkStorage& g_work_storage = *new WorkStorage();  // never destroyed, as the completion thread

class TracedWork : public c10d::Work {
 public:
  static void* operator new(size_t size) { return g_work_storage.take(size); }
  static void operator delete(void* block) { g_work_storage.give(block); }

  // `backend` (the one that made `inner`) is kept alive as long as this Work: the completion thread may
  // release a Work after the process group was destroyed, and a Work must not outlive its backend
  // (gloo's point-to-point Works free buffers of the backend's context).
  TracedWork(c10::intrusive_ptr<c10d::Work> inner, c10::intrusive_ptr<c10d::Backend> backend, bool host_completion,
             int64_t serial, int64_t enqueue_ns, int comm_slot, int64_t seq, uint8_t op)
      : c10d::Work(-1, inner->retrieveOpType()),
        backend_(std::move(backend)),
        inner_(std::move(inner)),
        host_completion_(host_completion),
        serial_(serial),
        enqueue_ns_(enqueue_ns),
        comm_slot_(comm_slot),
        seq_(seq),
        op_(op) {}

  bool isCompleted() override {
    bool done = inner_->isCompleted();
    if (done) complete();
    return done;
  }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override {
    inner_->synchronize();
    if (host_completion_) complete();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = inner_->wait(timeout);
    if (host_completion_) complete();
    return ok;
  }
  void blockCurrentStream() override { inner_->blockCurrentStream(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override { return inner_->getFutureResult(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

  // Record the completion now, once (whichever of wait(), isCompleted() and the poller sees it first).
  void complete() {
    if (done_.exchange(true, std::memory_order_acq_rel)) return;
    RingUse use;
    Ring* ring = use.get();
    if (ring == nullptr) return;
    int64_t now = now_ns();
    Record* record = ring->records + (serial_ - 1) % ring->capacity;
    if (static_cast<int64_t>(__atomic_load_n(&record->serial, __ATOMIC_ACQUIRE)) == serial_) store(&record->complete_ns, now);
    store(ring->header + kWLastCompleteNs, now);
    int64_t duration = now - enqueue_ns_;
    add(ring->header + kWWaitNsTotal, duration);
    if (comm_slot_ >= 0) {
      int64_t* entry = comm_counters(ring, comm_slot_);
      add(entry + kCCompleted, 1);
      int64_t* buckets = histogram(ring, comm_slot_);
      add(buckets + histogram_bucket(duration), 1);
      add(buckets + kHSumNs, duration);
      raise_to(entry + kCMaxDurationNs, duration);
    }
  }

  bool done() const { return done_.load(std::memory_order_acquire); }
  bool inner_completed() { return inner_->isCompleted(); }
  int64_t enqueue_ns() const { return enqueue_ns_; }
  int comm_slot() const { return comm_slot_; }
  int64_t seq() const { return seq_; }
  uint8_t op() const { return op_; }

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;  // declared first: destroyed after inner_
  c10::intrusive_ptr<c10d::Work> inner_;
  const bool host_completion_;
  const int64_t serial_;
  const int64_t enqueue_ns_;
  const int comm_slot_;
  const int64_t seq_;
  const uint8_t op_;
  std::atomic<bool> done_{false};
};

void Completions::add(c10::intrusive_ptr<TracedWork> work) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (incoming_.size() + polled_size_.load(std::memory_order_relaxed) >= kMaxTracked) return;
  incoming_.push_back(std::move(work));
}

size_t Completions::tracked() {
  std::lock_guard<std::mutex> guard(mutex_);
  return incoming_.size() + polled_size_.load(std::memory_order_relaxed);
}

void Completions::start() {
  std::lock_guard<std::mutex> guard(mutex_);
  if (thread_.joinable()) return;
  stop_ = false;
  thread_ = std::thread([this] { run(); });
}

void Completions::stop() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> guard(mutex_);
  incoming_.clear();
  polled_.clear();
  polled_size_.store(0);
}

void Completions::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    // Never woken by the issuing threads (that would cost them a system call): polls every
    // millisecond while Works are queued, every 10 ms otherwise.
    bool busy = !incoming_.empty() || !polled_.empty();
    wake_.wait_for(lock, busy ? std::chrono::milliseconds(1) : std::chrono::milliseconds(10));
    if (stop_) break;
    for (auto& work : incoming_) polled_.push_back(std::move(work));
    incoming_.clear();
    polled_size_.store(polled_.size(), std::memory_order_relaxed);
    lock.unlock();
    pass();
    lock.lock();
  }
}

// One poll over the queued Works (only this thread touches polled_).
void Completions::pass() {
  passes_.fetch_add(1, std::memory_order_relaxed);
  int64_t oldest_ns[kMaxCommCounters] = {0};
  int64_t oldest_seq[kMaxCommCounters];
  uint8_t oldest_op[kMaxCommCounters] = {0};
  int64_t first_ns = 0;
  uint8_t first_op = 0;
  size_t kept = 0;
  for (auto& work : polled_) {
    if (!work->done() && work->inner_completed()) work->complete();
    if (work->done()) continue;
    int64_t enqueue = work->enqueue_ns();
    if (first_ns == 0 || enqueue < first_ns) {
      first_ns = enqueue;
      first_op = work->op();
    }
    int slot = work->comm_slot();
    if (slot >= 0 && (oldest_ns[slot] == 0 || enqueue < oldest_ns[slot])) {
      oldest_ns[slot] = enqueue;
      oldest_seq[slot] = work->seq();
      oldest_op[slot] = work->op();
    }
    polled_[kept++] = std::move(work);
  }
  polled_.resize(kept);
  polled_size_.store(kept, std::memory_order_relaxed);
  RingUse use;
  Ring* ring = use.get();
  if (ring == nullptr) return;
  store(ring->header + kWOldestInflightEnqueueNs, first_ns);
  store(ring->header + kWOldestInflightOp, first_op);
  int64_t used = load(ring->header + kWCommCountersUsed);
  for (int slot = 0; slot < used && slot < kMaxCommCounters; ++slot) {
    int64_t* entry = comm_counters(ring, slot);
    store(entry + kCInflightEnqueueNs, oldest_ns[slot]);
    store(entry + kCInflightSeq, oldest_ns[slot] ? oldest_seq[slot] : -1);
    store(entry + kCInflightOp, oldest_ns[slot] ? oldest_op[slot] : 0);
  }
}

int64_t tensors_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& tensor : tensors) total += static_cast<int64_t>(tensor.nbytes());
  return total;
}

uint8_t tensors_dtype(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() ? kDtypeNone : dtype_code(tensors.back().scalar_type());
}

// Computes the communicator id of a split-off group in Python (same hash as everywhere else).
py::object* const g_comm_id_of = new py::object();  // never destroyed: outlives the interpreter

class TracedBackend : public c10d::Backend {
 public:
  TracedBackend(c10::intrusive_ptr<c10d::Backend> inner, int64_t comm_id, std::vector<int> ranks,
                bool device_completion)
      : c10d::Backend(inner->getRank(), inner->getSize()),
        inner_(std::move(inner)),
        comm_id_(comm_id),
        ranks_(std::move(ranks)),
        host_completion_(!device_completion),
        send_seq_(ranks_.size()),
        recv_seq_(ranks_.size()) {
    setBoundDeviceId(inner_->getBoundDeviceId());
    c10d::Backend::setGroupUid(inner_->getGroupUid());
    setGroupDesc(inner_->getGroupDesc());
    setUsePgForSymmMemRendezvous(inner_->getUsePgForSymmMemRendezvous());
    for (auto& seq : send_seq_) seq.store(0);
    for (auto& seq : recv_seq_) seq.store(0);
  }

  const c10::intrusive_ptr<c10d::Backend>& inner() const { return inner_; }
  int64_t comm_id() const { return comm_id_; }

  // Capability and lifecycle calls go to the wrapped backend.
  bool supportsSplitting() const override { return inner_->supportsSplitting(); }
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  bool supportsTimeEstimation() const override { return inner_->supportsTimeEstimation(); }
  bool supportsShrinking() const override { return inner_->supportsShrinking(); }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  const std::string getBackendName() const override { return inner_->getBackendName(); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner_->getBackendOptions(); }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override {
    inner_->registerOnCompletionHook(std::move(hook));
    onCompletionHook_ = [](std::shared_ptr<c10d::WorkInfo>) {};  // hasHooks() answers as the inner one
  }
  void waitForPendingWorks() override { inner_->waitForPendingWorks(); }
  void enableCollectivesTiming() override { inner_->enableCollectivesTiming(); }
  void setGroupUid(const std::string& pg_uid) override {
    c10d::Backend::setGroupUid(pg_uid);
    inner_->setGroupUid(pg_uid);
  }
  void eagerConnectSingleDevice(at::Device device) override {
    inner_->setBoundDeviceId(getBoundDeviceId());
    inner_->eagerConnectSingleDevice(device);
  }
  c10d::ErrorType getError() override { return inner_->getError(); }
  std::shared_ptr<c10::Allocator> getMemAllocator() override { return inner_->getMemAllocator(); }
  at::Tensor allocateTensor(long size, at::TensorOptions options) override {
    return inner_->allocateTensor(size, options);
  }
  bool supportsTensorAlloc(c10::DeviceIndex device) override { return inner_->supportsTensorAlloc(device); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }
  void suspend() override { inner_->suspend(); }
  void resume() override { inner_->resume(); }
  std::unordered_map<std::string, uint64_t> getMemoryStats() override { return inner_->getMemoryStats(); }

  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    auto child = inner_->split(store, ranks, opts);
    if (!child) return child;
    std::vector<int> members;
    if (opts && !opts->global_ranks_in_group.empty()) {
      for (auto rank : opts->global_ranks_in_group) members.push_back(static_cast<int>(rank));
    } else {
      for (int rank : ranks) members.push_back(rank < static_cast<int>(ranks_.size()) ? ranks_[rank] : rank);
    }
    int64_t cid = 0;
    {
      py::gil_scoped_acquire gil;
      if (!*g_comm_id_of || g_comm_id_of->is_none()) return child;
      cid = (*g_comm_id_of)(members).cast<int64_t>();
    }
    return c10::make_intrusive<TracedBackend>(child, cid, members, !host_completion_);
  }

  void startCoalescing() override {
    inner_->startCoalescing();
    coalescing_ = true;
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    coalescing_ = false;
    auto work = inner_->endCoalescing();
    std::vector<Pending> pending;
    pending.swap(coalesced_);
    if (pending.empty()) return work;
    if (!work) {
      for (auto& op : pending) finish(op, work);
      return work;
    }
    c10::intrusive_ptr<c10d::Work> last;
    for (auto& op : pending) last = finish(op, work);
    return last;
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    auto op = begin(kBroadcast, tensors_bytes(tensors), tensors_dtype(tensors), global(opts.rootRank));
    return issue(op, [&] { return inner_->broadcast(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    auto op = begin(kAllReduce, tensors_bytes(tensors), tensors_dtype(tensors), -1);
    return issue(op, [&] { return inner_->allreduce(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override {
    auto op = begin(kAllReduce, tensors_bytes(tensors), tensors_dtype(tensors), -1);
    return issue(op, [&] { return inner_->allreduce_sparse(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    auto op = begin(kAllReduce, tensors_bytes(tensors), tensors_dtype(tensors), -1);
    return issue(op, [&] { return inner_->allreduce_coalesced(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    auto op = begin(kReduce, tensors_bytes(tensors), tensors_dtype(tensors), global(opts.rootRank));
    return issue(op, [&] { return inner_->reduce(tensors, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    auto op = begin(kAllGather, tensors_bytes(inputs), tensors_dtype(inputs), -1);
    return issue(op, [&] { return inner_->allgather(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    auto op = begin(kAllGather, input.nbytes(), dtype_code(input.scalar_type()), -1);
    return issue(op, [&] { return inner_->_allgather_base(output, input, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    auto op = begin(kAllGather, tensors_bytes(inputs), tensors_dtype(inputs), -1);
    return issue(op, [&] { return inner_->allgather_coalesced(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    auto op = begin(kAllGather, tensors_bytes(inputs), tensors_dtype(inputs), -1);
    return issue(op, [&] { return inner_->allgather_into_tensor_coalesced(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    auto op = begin(kGather, tensors_bytes(inputs), tensors_dtype(inputs), global(opts.rootRank));
    return issue(op, [&] { return inner_->gather(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    auto op = begin(kScatter, tensors_bytes(outputs), tensors_dtype(outputs), global(opts.rootRank));
    return issue(op, [&] { return inner_->scatter(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    auto op = begin(kReduceScatter, tensors_bytes(outputs), tensors_dtype(outputs), -1);
    return issue(op, [&] { return inner_->reduce_scatter(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    auto op = begin(kReduceScatter, output.nbytes(), dtype_code(output.scalar_type()), -1);
    return issue(op, [&] { return inner_->_reduce_scatter_base(output, input, opts); });
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    auto op = begin(kReduceScatter, tensors_bytes(outputs), tensors_dtype(outputs), -1);
    return issue(op, [&] { return inner_->reduce_scatter_tensor_coalesced(outputs, inputs, opts); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    auto op = begin(kAllToAll, input.nbytes(), dtype_code(input.scalar_type()), -1);
    return issue(op, [&] { return inner_->alltoall_base(output, input, output_splits, input_splits, opts); });
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    auto op = begin(kAllToAll, tensors_bytes(inputs), tensors_dtype(inputs), -1);
    return issue(op, [&] { return inner_->alltoall(outputs, inputs, opts); });
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    auto op = begin(kBarrier, 0, 0, -1);
    try {
      inner_->monitoredBarrier(opts, wait_all_ranks);
    } catch (...) {
      complete_now(op);
      throw;
    }
    complete_now(op);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    auto op = begin(kSend, tensors_bytes(tensors), tensors_dtype(tensors), global(dst), dst);
    return issue(op, [&] { return inner_->send(tensors, dst, tag); });
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    auto op = begin(kRecv, tensors_bytes(tensors), tensors_dtype(tensors), global(src), src);
    return issue(op, [&] { return inner_->recv(tensors, src, tag); });
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    auto op = begin(kRecv, tensors_bytes(tensors), tensors_dtype(tensors), -1);
    return issue(op, [&] { return inner_->recvAnysource(tensors, tag); });
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    auto op = begin(kBarrier, 0, 0, -1);
    return issue(op, [&] { return inner_->barrier(opts); });
  }

 private:
  struct Pending {
    int64_t serial = 0;  // 0: not recorded (no ring attached)
    int64_t enqueue_ns = 0;
    int64_t seq = 0;
    int slot = -1;
    uint8_t op = 0;
  };

  int global(int group_rank) const {
    return group_rank >= 0 && group_rank < static_cast<int>(ranks_.size()) ? ranks_[group_rank] : -1;
  }

  // Write the op's record (issued now, in flight).
  Pending begin(uint8_t op, int64_t nbytes, uint8_t dtype, int peer, int group_peer = -1) {
    Pending pending;
    RingUse use;
    Ring* ring = use.get();
    if (ring == nullptr) return pending;
    if (ring != slot_ring_) {
      comm_slot_ = comm_slot(ring, comm_id_);
      slot_ring_ = ring;
    }
    int64_t seq;
    if (op == kSend || op == kRecv) {
      auto& seqs = op == kSend ? send_seq_ : recv_seq_;
      seq = group_peer >= 0 && group_peer < static_cast<int>(seqs.size())
                ? seqs[group_peer].fetch_add(1, std::memory_order_relaxed)
                : 0;
    } else {
      seq = collective_seq_.fetch_add(1, std::memory_order_relaxed);
    }
    int64_t serial = ring->serial.fetch_add(1, std::memory_order_relaxed) + 1;
    int64_t now = now_ns();
    Record* record = ring->records + (serial - 1) % ring->capacity;
    __atomic_store_n(&record->serial, 0, __ATOMIC_RELAXED);
    std::atomic_thread_fence(std::memory_order_release);
    record->comm_id = comm_id_;
    record->seq = seq;
    record->nbytes = nbytes;
    record->enqueue_ns = now;
    record->complete_ns = 0;
    record->step = load(ring->header + kWStepCount);
    record->rank = ring->rank;
    record->peer = peer;
    record->op = op;
    record->dtype = dtype;
    record->flags = kFlagProcessGroup;
    __atomic_store_n(&record->serial, serial, __ATOMIC_RELEASE);
    add(ring->header + kWCallsByOp + op, 1);
    add(ring->header + kWBytesByOp + op, nbytes);
    store(ring->header + kWLastEnqueueNs, now);
    if (comm_slot_ >= 0) {
      int64_t* entry = comm_counters(ring, comm_slot_);
      add(entry + kCIssued, 1);
      store(entry + kCLastOp, op);
    }
    pending.serial = serial;
    pending.enqueue_ns = now;
    pending.seq = seq;
    pending.slot = comm_slot_;
    pending.op = op;
    return pending;
  }

  c10::intrusive_ptr<c10d::Work> finish(const Pending& op, c10::intrusive_ptr<c10d::Work> work) {
    if (!work) {
      complete_now(op);
      return work;
    }
    auto traced = c10::make_intrusive<TracedWork>(std::move(work), inner_, host_completion_, op.serial,
                                                  op.enqueue_ns, op.slot, op.seq, op.op);
    g_completions.add(traced);
    return traced;
  }

  void complete_now(const Pending& op) {
    if (op.serial == 0) return;
    TracedWork(c10::make_intrusive<c10d::Work>(), nullptr, true, op.serial, op.enqueue_ns, op.slot, op.seq, op.op)
        .complete();
  }

  template <typename Call>
  c10::intrusive_ptr<c10d::Work> issue(const Pending& op, Call&& call) {
    if (op.serial == 0) return call();
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = call();
    } catch (...) {
      complete_now(op);
      throw;
    }
    if (!work && coalescing_) {
      coalesced_.push_back(op);
      return work;
    }
    return finish(op, std::move(work));
  }

  c10::intrusive_ptr<c10d::Backend> inner_;
  const int64_t comm_id_;
  const std::vector<int> ranks_;
  const bool host_completion_;
  std::atomic<int64_t> collective_seq_{0};
  std::vector<std::atomic<int64_t>> send_seq_;
  std::vector<std::atomic<int64_t>> recv_seq_;
  Ring* slot_ring_ = nullptr;
  int comm_slot_ = -1;
  bool coalescing_ = false;
  std::vector<Pending> coalesced_;
};

// Test double for device completion on machines without a GPU: a backend whose Works return from
// wait() at once (as an NCCL Work does once its kernel is enqueued) and complete only when released.
class HeldWork : public c10d::Work {
 public:
  explicit HeldWork(std::shared_ptr<std::atomic<bool>> released) : released_(std::move(released)) {}
  bool isCompleted() override { return released_->load(); }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }

 private:
  std::shared_ptr<std::atomic<bool>> released_;
};

class HeldBackend : public c10d::Backend {
 public:
  HeldBackend(int rank, int size)
      : c10d::Backend(rank, size), released_(std::make_shared<std::atomic<bool>>(false)) {}
  const std::string getBackendName() const override { return "held"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return c10::make_intrusive<HeldWork>(released_);
  }
  void release() { released_->store(true); }

 private:
  std::shared_ptr<std::atomic<bool>> released_;
};

// Reaches the backend tables of a ProcessGroup (protected members) through member pointers.
struct ProcessGroupTables : c10d::ProcessGroup {
  static auto& by_device(c10d::ProcessGroup& pg) { return pg.*(&ProcessGroupTables::deviceTypeToBackend_); }
  static auto& by_type(c10d::ProcessGroup& pg) { return pg.*(&ProcessGroupTables::backendTypeToBackend_); }
};

// Replace every backend of `pg` by what `replace` returns for it (the same backend: left alone).
template <typename Replace>
int replace_backends(c10d::ProcessGroup& pg, Replace&& replace) {
  int replaced = 0;
  for (auto& [type, backend] : ProcessGroupTables::by_type(pg)) {
    auto old = backend;
    auto updated = replace(old);
    if (updated.get() == old.get()) continue;
    backend = updated;
    for (auto& [device, by_device] : ProcessGroupTables::by_device(pg)) {
      if (by_device.get() == old.get()) by_device = updated;
    }
    ++replaced;
  }
  return replaced;
}

// Bench support: `n` all-reduces of `tensor` on `backend`, each waited for, nothing else in the loop
// but, with `interval_ns` > 0, a sleep until the next op is due (a paced rate); returns this thread's
// CPU ns per op. Two names, so callgrind's inclusive cost of each over `n` is the per-op cost of the
// bare and of the traced backend within one run.
template <int Which>
__attribute__((noinline)) double run_ops(const c10::intrusive_ptr<c10d::Backend>& backend, at::Tensor tensor,
                                         int64_t n, int64_t interval_ns) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  timespec start, end, due;
  clock_gettime(CLOCK_MONOTONIC, &due);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
  for (int64_t i = 0; i < n; ++i) {
    backend->allreduce(tensors)->wait();
    if (interval_ns > 0) {
      due.tv_nsec += interval_ns;
      while (due.tv_nsec >= 1000000000L) {
        due.tv_nsec -= 1000000000L;
        ++due.tv_sec;
      }
      clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &due, nullptr);
    }
  }
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
  return ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / static_cast<double>(n);
}

extern "C" __attribute__((noinline, visibility("default"))) double megatrace_bench_bare_ops(
    const c10::intrusive_ptr<c10d::Backend>& backend, const at::Tensor& tensor, int64_t n, int64_t interval_ns) {
  return run_ops<0>(backend, tensor, n, interval_ns);
}

extern "C" __attribute__((noinline, visibility("default"))) double megatrace_bench_traced_ops(
    const c10::intrusive_ptr<c10d::Backend>& backend, const at::Tensor& tensor, int64_t n, int64_t interval_ns) {
  return run_ops<1>(backend, tensor, n, interval_ns);
}

// ---- module functions ----

void attach(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "megatrace: cannot open ", path);
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < kHeaderSize) {
    ::close(fd);
    TORCH_CHECK(false, "megatrace: ", path, " is too short for a ring file");
  }
  void* base = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  TORCH_CHECK(base != MAP_FAILED, "megatrace: cannot map ", path);
  auto* header = static_cast<int64_t*>(base);
  int64_t capacity = header[kWCapacity];
  int64_t records_offset = header[kWRecordsOffset];
  if (header[kWVersion] != kFormatVersion || header[kWRecordSize] != kRecordSize || capacity < 1 ||
      records_offset + capacity * kRecordSize > st.st_size) {
    munmap(base, st.st_size);
    TORCH_CHECK(false, "megatrace: ", path, " is not a version ", kFormatVersion, " ring file");
  }
  auto* ring = new Ring();
  ring->base = static_cast<char*>(base);
  ring->size = st.st_size;
  ring->header = header;
  ring->records = reinterpret_cast<Record*>(ring->base + records_offset);
  ring->capacity = capacity;
  ring->rank = static_cast<int32_t>(header[kWRank]);
  Ring* previous = g_ring.exchange(ring);
  TORCH_CHECK(previous == nullptr, "megatrace: a ring was already attached");
  // A forked child (a data loader worker) shares the mapping but has no completion thread: it must
  // not write into its parent's ring.
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { g_ring.store(nullptr); }); });
  g_completions.start();
}

// A completed span that is no op (a pause, from the Python side): one record, numbered like the ops.
void record_span(int64_t op, int32_t peer, int64_t seq, int64_t start_ns, int64_t end_ns, int64_t step,
                 int64_t nbytes) {
  TORCH_CHECK(op > 0 && op < kMaxOps, "megatrace: record op ", op, " is outside the op table");
  RingUse use;
  Ring* ring = use.get();
  if (ring == nullptr) return;
  int64_t serial = ring->serial.fetch_add(1, std::memory_order_relaxed) + 1;
  Record* record = ring->records + (serial - 1) % ring->capacity;
  __atomic_store_n(&record->serial, 0, __ATOMIC_RELAXED);
  std::atomic_thread_fence(std::memory_order_release);
  std::memset(reinterpret_cast<char*>(record) + sizeof(record->serial), 0, sizeof(Record) - sizeof(record->serial));
  record->seq = seq;
  record->nbytes = static_cast<uint64_t>(nbytes);
  record->enqueue_ns = start_ns;
  record->complete_ns = end_ns;
  record->step = step;
  record->rank = ring->rank;
  record->peer = peer;
  record->op = static_cast<uint8_t>(op);
  __atomic_store_n(&record->serial, serial, __ATOMIC_RELEASE);
  add(ring->header + kWCallsByOp + op, 1);
}

void detach() {
  g_completions.stop();
  Ring* ring = g_ring.exchange(nullptr);
  while (g_users.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  if (ring != nullptr) {
    munmap(ring->base, ring->size);
    delete ring;
  }
}

}  // namespace megatrace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace megatrace;
  m.doc() = "Megatrace native capture: records every op reaching a c10d backend into the ring file.";
  m.def("layout", [] {
    py::dict layout;
    for (const auto& [name, value] : layout_entries()) layout[name] = value;
    return layout;
  }, "The ring layout this library was compiled with, by the names of megatrace.tracer.format.");
  m.def("attach", &attach, "Map the ring file at `path` and record into it; starts the completion thread.");
  m.def("detach", &detach, py::call_guard<py::gil_scoped_release>(),
        "Stop recording, stop the completion thread and unmap the ring.");
  m.def("record_span", &record_span, py::arg("op"), py::arg("peer"), py::arg("seq"), py::arg("start_ns"),
        py::arg("end_ns"), py::arg("step"), py::arg("nbytes") = 0,
        "Write a completed span that is no op (a pause, a garbage collection) as a ring record.");
  m.def("serial", [] {
    Ring* ring = g_ring.load();
    return ring ? ring->serial.load() : int64_t{0};
  }, "Ops recorded since attach.");
  m.def("tracked", [] { return g_completions.tracked(); }, "Works the completion thread still polls.");
  m.def("passes", [] { return g_completions.passes(); }, "Poll passes the completion thread made.");
  m.def("bench_bare_ops", &megatrace_bench_bare_ops, py::arg("backend"), py::arg("tensor"), py::arg("n"),
        py::arg("interval_ns") = 0, py::call_guard<py::gil_scoped_release>(),
        "Bench: CPU ns per all-reduce + wait on `backend` (the bare one), paced to one per `interval_ns`.");
  m.def("bench_traced_ops", &megatrace_bench_traced_ops, py::arg("backend"), py::arg("tensor"), py::arg("n"),
        py::arg("interval_ns") = 0, py::call_guard<py::gil_scoped_release>(),
        "Bench: the same loop, under another name, for the traced backend.");
  m.def("set_comm_id_function", [](py::object fn) { *g_comm_id_of = std::move(fn); },
        "The Python function giving the communicator id of a list of global ranks (for split groups).");
  m.def(
      "wrap",
      [](c10::intrusive_ptr<c10d::Backend> inner, int64_t cid, std::vector<int> ranks, bool device_completion) {
        return c10::intrusive_ptr<c10d::Backend>(
            c10::make_intrusive<TracedBackend>(std::move(inner), cid, std::move(ranks), device_completion));
      },
      "A backend recording every op of `inner` as communicator `cid` of global ranks `ranks`.");
  m.def("is_traced", [](const c10::intrusive_ptr<c10d::Backend>& backend) {
    return dynamic_cast<TracedBackend*>(backend.get()) != nullptr;
  });
  m.def(
      "wrap_group",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t cid, std::vector<int> ranks,
         std::vector<std::string> host_completion) {
        return replace_backends(*pg, [&](const c10::intrusive_ptr<c10d::Backend>& backend) {
          if (dynamic_cast<TracedBackend*>(backend.get()) != nullptr) return backend;
          auto name = backend->getBackendName();
          bool device_completion =
              std::find(host_completion.begin(), host_completion.end(), name) == host_completion.end();
          return c10::intrusive_ptr<c10d::Backend>(
              c10::make_intrusive<TracedBackend>(backend, cid, ranks, device_completion));
        });
      },
      "Wrap every backend of process group `pg` (communicator `cid` of global ranks `ranks`); returns how "
      "many were wrapped. Backends named in `host_completion` complete when wait() returns.");
  m.def(
      "unwrap_group",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
        return replace_backends(*pg, [](const c10::intrusive_ptr<c10d::Backend>& backend) {
          auto* traced = dynamic_cast<TracedBackend*>(backend.get());
          return traced != nullptr ? traced->inner() : backend;
        });
      },
      "Give process group `pg` its own backends back; returns how many were unwrapped.");
  m.def("held_backend", [](int rank, int size) {
    auto backend = c10::make_intrusive<HeldBackend>(rank, size);
    py::object release = py::cpp_function([backend] { backend->release(); });
    return py::make_tuple(c10::intrusive_ptr<c10d::Backend>(backend), release);
  }, "Test double: (backend whose Works complete only once release() is called, release).");
}
