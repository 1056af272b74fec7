// The mirror job (see include/job/vblk/mirror.h): QEMU 7.2's mirror_run on the
// block-copy engine, with the MirrorTop filter recording or forwarding guest
// writes.
#include "vblk/mirror.h"

#include <algorithm>
#include <climits>

#include "vblk/buffer.h"
#include "vblk/chain.h"
#include "vblk/image_format.h"
#include "vblk/named_bitmap.h"

namespace vblk {

namespace {
constexpr uint64_t kDefaultBufSize = 16 << 20;  // QEMU's DEFAULT_MIRROR_BUF_SIZE
constexpr uint64_t kSliceNs = 100'000'000;      // QEMU's BLOCK_JOB_SLICE_TIME

// Keeps the filter and the engine state alive until writes that entered
// the filter before it left the graph are done (they use both).
// A target to drop afterwards comes along (drive-mirror's, not switched
// to: the job holds the last reference but the graph's): closed, then out
// of the graph with its implicit children, which frees its file and locks.
Task<void> release_filter(std::shared_ptr<MirrorTop> f, std::unique_ptr<BlockCopyState> bcs, Graph* graph,
                          std::shared_ptr<Node> drop_target) {
  co_await f->quiesce();
  co_await f->drain();
  f->detach();
  bcs.reset();
  if (drop_target) {
    co_await drop_target->drain();
    (void)co_await drop_target->close();
    std::vector<std::string> names = {drop_target->node_name()};
    for (const auto& c : drop_target->children()) names.push_back(c.node->node_name());
    drop_target.reset();
    for (const auto& n : names) (void)graph->remove(n);
  }
}
}  // namespace

MirrorJob::MirrorJob(JobManager& mgr, const std::string& id, bool auto_finalize, bool auto_dismiss)
    : BlockJob(mgr, id, auto_finalize, auto_dismiss) {}

MirrorJob::~MirrorJob() = default;

uint64_t MirrorJob::progress_current() const {
  if (!bcs_) return final_done_;
  if (!started_copy_) return 0;
  // Stream and commit count every byte they looked at, copied or not.
  if (auto_complete()) return len_ - std::min(len_, bcs_->bitmap().count() + bcs_->in_flight_bytes());
  return bcs_->progress_done() + filter_->active_bytes_done();
}

uint64_t MirrorJob::progress_total() const {
  if (!bcs_) return final_total_;
  if (!started_copy_) return 0;
  if (auto_complete()) return len_;
  return progress_current() + bcs_->bitmap().count() + bcs_->in_flight_bytes() + filter_->active_bytes_in_flight();
}

Task<Status> MirrorJob::init_bitmap() {
  DirtyBitmap& bm = bcs_->bitmap();
  if (sync_ == Sync::Full) {
    bm.set_all();
  } else if (sync_ == Sync::Stream) {
    // What the layers below the source (down to the new backing) allocate,
    // where the source itself does not.
    auto mark = [&](Node& n, bool set) -> Task<Status> {
      for (uint64_t pos = 0; pos < len_;) {
        auto st = co_await n.block_status(pos, len_ - pos);
        if (!st) co_return st.error();
        const uint64_t cnt = std::max<uint64_t>(1, std::min(st->bytes, len_ - pos));
        if (st->flags & kStatusAllocated) {
          if (set) {
            bm.set(pos, cnt);
          } else {
            bm.reset(pos, cnt);
          }
        }
        pos += cnt;
      }
      co_return Status{};
    };
    for (Node* n = filter_or_cow_child(*source_); n && n != new_backing_.get(); n = filter_or_cow_child(*n))
      if (Status st = co_await mark(*n, true); !st.ok()) co_return st;
    if (Status st = co_await mark(*source_, false); !st.ok()) co_return st;
    filter_->clean_under_writes();
  } else if (sync_ == Sync::Commit || sync_ == Sync::CommitIntermediate) {
    // What the layers above the base allocate (QEMU's
    // bdrv_is_allocated_above up to the base's overlay); the base has the
    // rest already.
    for (Node* n = source_.get(); n && n != target_.get(); n = filter_or_cow_child(*n)) {
      for (uint64_t pos = 0; pos < len_;) {
        if (is_cancelled()) co_return Status{};
        auto st = co_await n->block_status(pos, len_ - pos);
        if (!st) co_return st.error();
        const uint64_t cnt = std::max<uint64_t>(1, std::min(st->bytes, len_ - pos));
        if (st->flags & kStatusAllocated) bm.set(pos, cnt);
        pos += cnt;
      }
    }
  } else if (sync_ == Sync::Top) {
    // What the source's own layer allocates; the target reads the rest
    // from its backing chain (QEMU's bdrv_is_allocated_above up to the
    // overlay of the base).
    for (uint64_t pos = 0; pos < len_;) {
      if (is_cancelled()) co_return Status{};
      auto st = co_await source_->block_status(pos, len_ - pos);
      if (!st) co_return st.error();
      const uint64_t n = std::max<uint64_t>(1, std::min(st->bytes, len_ - pos));
      if (st->flags & kStatusAllocated) bm.set(pos, n);
      pos += n;
    }
  }
  co_return Status{};
}

Task<Status> MirrorJob::run() {
  len_ = source_->length();
  if (sync_ == Sync::Stream) {
    // Nothing below the source down to the new backing: nothing to do
    // (QEMU reports len 0 and changes no link).
    if (filter_or_cow_child(*source_) == new_backing_.get()) co_return Status{};
  } else if (sync_ == Sync::Commit || sync_ == Sync::CommitIntermediate) {
    // Commit grows a shorter base to the top's size.
    if (target_->length() < len_)
      if (Status st = co_await target_->truncate(len_, false); !st.ok()) co_return st;
  } else if (target_->length() != len_) {
    set_error_text("Source and target image have different sizes");
    co_return Error(EINVAL, "Source and target image have different sizes");
  }
  started_copy_ = true;
  std::weak_ptr<Job> weak = weak_from_this();
  // Guest writes dirty the bitmap from now on, so the first pass misses none.
  filter_->attach(bcs_.get(), [weak] {
    if (auto j = weak.lock()) {
      auto* m = static_cast<MirrorJob*>(j.get());
      if (m->idle_) m->enter();
    }
  });
  // A request already under way on the source when start_mirror_job put
  // the filter above it goes on to the source alone: it marks nothing
  // dirty and never reaches the target. If it lands after the engine has
  // copied its clusters, the target keeps the old data there for good (a
  // guest write into a hole of the source, in flight while the engine wrote
  // that cluster to the target as zeroes, was lost after the switch:
  // test_complete_while_fio_writes_and_verifies). Nothing is looked at or
  // copied until those requests are done; from here on every write passes
  // the filter, which is attached now.
  co_await filter_->drain_source();
  if (len_ == 0) {
    // Nothing to copy: ready at once, then wait for complete or cancel.
    transition_to_ready();
    while (!cancel_requested() && !should_complete_) co_await yield();
    co_return Status{};
  }
  if (Status st = co_await init_bitmap(); !st.ok()) co_return st;
  if (write_blocking_) {
    filter_->start_write_blocking([weak](int err) {
      if (auto j = weak.lock()) static_cast<MirrorJob*>(j.get())->on_active_error(err);
    });
  }
  for (;;) {
    if (!active_error_.ok()) co_return active_error_;
    co_await pause_point();
    if (is_cancelled()) co_return Status{};
    if (bcs_->bitmap().count() || bcs_->in_flight_bytes()) {
      Status st = co_await copy_pass();
      if (!st.ok()) co_return st;
      continue;
    }
    if (auto_complete()) {
      // A stream that ignored an error ends with it, keeping the backing
      // file it could not copy everything from (QEMU's stream_run).
      if (!ignored_error_.ok()) co_return ignored_error_;
      co_return co_await relink();
    }
    if (!is_ready()) {
      // Out of the first pass: from here a cancel finishes the copy and
      // leaves a consistent target.
      if (Status st = co_await flush_target(); !st.ok()) co_return st;
      if (bcs_->bitmap().count() || !active_error_.ok() || should_pause()) continue;
      transition_to_ready();
    }
    if (should_complete_ || cancel_requested()) {
      // Stop guest writes at the filter's entry and let those inside end;
      // if nothing got dirty meanwhile, source and target agree.
      co_await filter_->hold();
      if (bcs_->bitmap().count() == 0 && bcs_->in_flight_bytes() == 0 && active_error_.ok()) {
        // The last flush fails under the target's error policy, as QEMU's
        // mirror_flush: going round again would spin on a dead target
        // forever, busy and never reporting.
        if (Status st = co_await target_->flush(); !st.ok()) {
          filter_->release(nullptr);
          if (error_action(on_target_error_, false, st.error().code) == ErrorAction::Report) co_return st;
          continue;
        }
        // drive-mirror's target takes the source's backing chain.
        if (target_backing_)
          if (Status st = co_await image::set_backing(*target_, target_backing_, image::backing_file_name(*target_),
                                                      image::backing_file_format(*target_));
              !st.ok()) {
            filter_->release(nullptr);
            co_return st;
          }
        co_return Status{};  // held until exit_common
      }
      filter_->release(nullptr);
      continue;
    }
    // Ready and in sync: wait for guest writes (they kick) or a verb.
    idle_ = true;
    co_await sleep_ns(kSliceNs);
    idle_ = false;
  }
}

Task<Status> MirrorJob::flush_target() {
  for (;;) {
    Status st = co_await target_->flush();
    if (st.ok()) co_return st;
    ErrorAction act = error_action(on_target_error_, false, st.error().code);
    if (act == ErrorAction::Report) co_return st;
    if (act == ErrorAction::Stop) co_await pause_point();
    if (is_cancelled()) co_return Status{};
  }
}

Task<Status> MirrorJob::copy_pass() {
  std::weak_ptr<Job> weak = weak_from_this();
  for (;;) {
    if (is_cancelled() || should_pause()) co_return Status{};
    call_ = bcs_->copy_async(0, len_, false, [weak](BlockCopyCall&) {
      if (auto j = weak.lock()) static_cast<MirrorJob*>(j.get())->enter();
    });
    while (!call_->finished() && !is_cancelled() && active_error_.ok()) co_await yield();
    std::shared_ptr<BlockCopyCall> call = std::move(call_);
    if (!call->finished()) {
      // Cancelled, or a write-blocking write failed: stop the call.
      call->cancel();
      co_await call->wait();
      co_return Status{};
    }
    if (call->succeeded() || is_cancelled()) co_return Status{};
    if (call->cancelled()) {
      // A pause stopped it; the main loop passes its pause point.
      co_return Status{};
    }
    // A stream copies by reading with copy-on-read in QEMU: every error it
    // meets is a read's.
    const bool is_read = call->error_is_read() || sync_ == Sync::Stream;
    ErrorAction act = error_action(is_read ? on_source_error_ : on_target_error_, is_read, call->status().error().code);
    if (act == ErrorAction::Report) co_return call->status();
    if (act == ErrorAction::Stop) co_await pause_point();
    if (act == ErrorAction::Ignore && sync_ == Sync::Stream) {
      // QEMU's stream goes on past the chunk (not retried) and ends with
      // the first such error.
      if (ignored_error_.ok()) ignored_error_ = call->status();
      bcs_->bitmap().reset(call->error_offset(), call->error_bytes());
    }
  }
}

void MirrorJob::on_active_error(int err) {
  ErrorAction act = error_action(on_target_error_, false, err);
  if (act == ErrorAction::Report && active_error_.ok()) {
    active_error_ = Error(err);
    enter();
  }
}

void MirrorJob::on_pause() {
  if (call_ && !call_->finished()) call_->cancel();
}

Task<Status> MirrorJob::relink() {
  // The copied data must be durable before a header stops pointing at the
  // layers it came from: killed after the new link but with the copy's L2
  // entries still in the cache, the top would read zeroes or older data
  // there (QEMU 7.2 has this window; scripts/kill_matrix.py found it).
  VBLK_CO_TRY(co_await flush_target());
  if (is_cancelled()) co_return Status{};
  if (sync_ == Sync::Stream) {
    std::string fmt = new_backing_ ? new_backing_->driver() : std::string();
    co_return co_await image::set_backing(*source_, new_backing_, backing_str_, fmt);
  }
  co_return co_await image::set_backing(*overlay_, target_, backing_str_, target_->driver());
}

bool MirrorJob::on_cancel(bool force) {
  // Before ready every cancel is a forced one (QEMU's mirror_cancel); once
  // ready, a soft cancel completes the copy without switching. Stream and
  // commit jobs have no soft cancel.
  force = force || !is_ready() || auto_complete();
  if (force && call_ && !call_->finished()) call_->cancel();
  return force;
}

void MirrorJob::on_set_speed(uint64_t speed) { bcs_->set_speed(speed); }

Status MirrorJob::on_complete() {
  should_complete_ = true;
  if (!paused()) enter();
  return {};
}

void MirrorJob::exit_common(bool switch_to_target) {
  if (exited_) return;
  exited_ = true;
  switched_ = switch_to_target;
  // The job's own use of the target ends first: the users it takes over
  // need to write it.
  target_ref_.reset();
  chain_claims_.clear();
  if (overlay_) {
    overlay_->set_backing_filtered(false);
    if (Node* b = overlay_->child("backing")) (void)b->refresh_perms();
  }
  filter_->detach();
  graph_->remove_filter(filter_, switch_to_target ? target_ : source_);
  if (quiesced_ && switch_to_target && target_.get() != &filter_->filtered()) {
    // Nothing is inside the filter: it can sit over the target from now
    // on, and the source is free the moment the job has ended.
    filter_->refilter(target_);
    filter_->release(nullptr);
  } else {
    filter_->release(switch_to_target ? target_ : nullptr);
  }
  manager().unblock(source_.get());
  manager().unblock(target_.get());  // (the same node for a stream: no-op)
}

Status MirrorJob::prepare() {
  exit_common(should_complete_);
  return {};
}

void MirrorJob::abort() { exit_common(false); }

// A job that concludes as soon as it completes (auto-finalize, alone)
// holds every request at its filter and lets those inside end, so that its
// end can let go of the source (completed) at once: blockdev-del of the old
// image right after BLOCK_JOB_COMPLETED works, as in QEMU, whose job ends
// drained. (Not for a job that waits in pending: the guest would wait.)
Task<void> MirrorJob::before_exit() {
  if (!auto_finalize() || in_group()) co_return;
  co_await filter_->hold_all();
  quiesced_ = true;
}

void MirrorJob::clean() {
  if (cleaned_) return;
  cleaned_ = true;
  exit_common(false);
  final_done_ = progress_current();
  final_total_ = progress_total();
  std::shared_ptr<Node> drop_target;
  if (owns_target_ && !switched_) drop_target = std::move(target_);
  spawn_detached(release_filter(filter_, std::move(bcs_), graph_, std::move(drop_target)));
}

Result<std::shared_ptr<MirrorJob>> start_mirror(JobManager& mgr, Graph& graph, const MirrorArgs& a) {
  auto not_found = [](const std::string& n) {
    return Error(ENOENT, "Cannot find device='" + n + "' nor node-name='" + n + "'");
  };
  // qmp_get_root_bs: the source must not be a child of another node.
  auto src = graph.find(a.device);
  if (!src) return not_found(a.device);
  if (graph.parent_of(*src)) return Error(EINVAL, "Need a root block node");
  auto tgt = graph.find(a.target);
  if (!tgt) return not_found(a.target);

  // blockdev_mirror_common
  const uint64_t g = a.granularity;
  if (g != 0 && (g < 512 || g > (64u << 20)))
    return Error(EINVAL, "Parameter 'granularity' expects a value in range [512B, 64MB]");
  if (g & (g - 1)) return Error(EINVAL, "Parameter 'granularity' expects a power of 2");
  VBLK_TRY(mgr.check_not_busy(src.get(), src->node_name()));
  VBLK_TRY(mgr.check_not_busy(tgt.get(), tgt->node_name()));
  MirrorJob::Sync sync = MirrorJob::Sync::Full;
  if (a.sync == "top") {
    // Without a backing file, top is full.
    if (src->child("backing")) sync = MirrorJob::Sync::Top;
  } else if (a.sync == "none") {
    sync = MirrorJob::Sync::None;
  }
  if (a.replaces) {
    auto r = graph.find(*a.replaces);
    if (!r) return Error(ENOENT, "Failed to find node with node-name='" + *a.replaces + "'");
    // Only the source itself can be replaced here (QEMU also allows nodes
    // the source reaches through filters that change no data).
    if (r != src)
      return Error(EINVAL, "Cannot replace '" + *a.replaces + "' by a node mirrored from '" + a.device +
                               "', because it cannot be guaranteed that doing so would not lead to an abrupt "
                               "change of visible data");
  }
  // mirror_start
  if (a.sync == "incremental" || a.sync == "bitmap") return Error(EINVAL, "Sync mode '" + a.sync + "' not supported");
  MirrorJobParams p;
  p.job_id = a.job_id.value_or(std::string());
  p.filter_node_name = a.filter_node_name.value_or(std::string());
  p.sync = sync;
  p.granularity = g;
  p.buf_size = a.buf_size;
  p.speed = a.speed;
  p.on_source_error = a.on_source_error;
  p.on_target_error = a.on_target_error;
  p.unmap = a.unmap;
  p.write_blocking = a.write_blocking;
  p.auto_finalize = a.auto_finalize;
  p.auto_dismiss = a.auto_dismiss;
  p.target_backing = a.target_backing;
  p.owns_target = a.owns_target;
  return start_mirror_job(mgr, graph, src, tgt, p);
}

namespace {

// The layers a commit or stream copies out of or past, claimed as QEMU's
// commit_start, mirror_start_job (active commit) and stream_start claim
// them. (An intermediate commit's overlay keeps reading the top directly,
// where QEMU puts its commit_top filter in between: the overlay's backing
// edge is marked filtered for the job's time, so it claims nothing, as
// through QEMU's filter.)
Result<std::vector<NodeRef>> claim_chain(const std::string& desc, Graph& graph, const std::shared_ptr<Node>& src,
                                         const std::shared_ptr<Node>& tgt, const MirrorJobParams& p) {
  std::vector<NodeRef> claims;
  Node* from = nullptr;
  Node* until = nullptr;
  uint32_t shared = 0;
  switch (p.sync) {
    case MirrorJob::Sync::Commit:
      from = filter_or_cow_child(*src), until = tgt.get(), shared = kPermWrite | kPermWriteUnchanged;
      break;
    case MirrorJob::Sync::CommitIntermediate:
      from = src.get(), until = tgt.get(), shared = kPermWrite | kPermWriteUnchanged;
      break;
    case MirrorJob::Sync::Stream:
      from = filter_or_cow_child(*src), until = p.new_backing.get(), shared = kPermConsistentRead | kPermWriteUnchanged;
      break;
    default: return claims;
  }
  const std::vector<std::shared_ptr<Node>> nodes = graph.nodes();
  for (Node* n = from; n && n != until; n = filter_or_cow_child(*n)) {
    auto it = std::find_if(nodes.begin(), nodes.end(), [&](const auto& s) { return s.get() == n; });
    if (it == nodes.end()) continue;  // not in the graph: nobody else can use it
    NodeRef& r = claims.emplace_back(*it);
    r.set_user(desc, "intermediate node");
    VBLK_TRY(r.set_perms(PermPair{0, shared}));
  }
  return claims;
}

}  // namespace

Result<std::shared_ptr<MirrorJob>> start_mirror_job(JobManager& mgr, Graph& graph, const std::shared_ptr<Node>& src,
                                                    const std::shared_ptr<Node>& tgt, const MirrorJobParams& p) {
  // mirror_start_job
  const uint64_t g = p.granularity;
  const uint64_t gran = g ? g : default_bitmap_granularity(image::cluster_size(*tgt));
  if (p.buf_size < 0) return Error(EINVAL, "Invalid parameter 'buf-size'");
  uint64_t buf = p.buf_size ? static_cast<uint64_t>(p.buf_size) : kDefaultBufSize;
  buf = align_up(buf, gran);
  const bool stream = p.sync == MirrorJob::Sync::Stream;
  if (src == tgt && !stream) return Error(EINVAL, "Can't mirror node into itself");
  const std::string& fname = p.filter_node_name;
  auto check_filter_name = [&]() -> Status {
    if (fname.empty()) return {};
    if (!id_wellformed(fname)) return Error(EINVAL, "Invalid node-name: '" + fname + "'");
    if (fname.size() >= 32) return Error(EINVAL, "Node name too long");
    if (graph.find(fname)) return Error(EEXIST, "Duplicate nodes with node-name='" + fname + "'");
    return {};
  };
  if (!p.job_before_filter) {
    // (block-stream's filter comes from bdrv_insert_node, which says so.)
    if (Status st = check_filter_name(); !st)
      return stream ? Error(st.error().code, "Could not create node: " + st.error().what()) : st.take_error();
  }
  VBLK_TRY(mgr.check_new_id(p.job_id));

  // block_job_create: the job exists (JOB_STATUS_CHANGE created) before
  // its speed and the target's permissions are checked.
  auto created = mgr.create<MirrorJob>(p.job_id, p.auto_finalize, p.auto_dismiss);
  if (!created.ok()) return created.take_error();
  std::shared_ptr<MirrorJob> job = *created;
  if (p.speed && *p.speed < 0) {
    mgr.early_fail(job);
    return Error(EINVAL, "Parameter 'speed' expects a non-negative value");
  }
  if (p.job_before_filter) {
    if (Status st = check_filter_name(); !st) {
      mgr.early_fail(job);
      return st.take_error();
    }
  }
  // The target: written by the job, only write-unchanged shared (QEMU's
  // blk_new(BLK_PERM_WRITE, BLK_PERM_WRITE_UNCHANGED)); a commit's base is
  // read by the chain above it meanwhile, and may need to grow.
  PermPair tp{kPermWrite, kPermWriteUnchanged};
  if (p.sync == MirrorJob::Sync::Commit) {
    tp.shared |= kPermConsistentRead | kPermWrite;
    if (tgt->length() < src->length()) tp.perm |= kPermResize;
  } else if (p.sync == MirrorJob::Sync::CommitIntermediate) {
    // QEMU's commit_start base: read, written and resized by the job; the
    // chain above reads it, nobody else writes it.
    tp = PermPair{kPermConsistentRead | kPermWrite | kPermResize, kPermConsistentRead | kPermWriteUnchanged};
  }
  // (A stream writes its source through the node itself, which its users
  // keep using: no reference of the job's own.)
  if (!stream) {
    job->target_ref_ = NodeRef(tgt);
    if (Status st = job->target_ref_.set_perms(tp); !st) {
      job->target_ref_.reset();
      mgr.early_fail(job);
      return st.take_error();
    }
  }
  if (tgt->read_only()) {
    job->target_ref_.reset();
    mgr.early_fail(job);
    return Error(EACCES, "Block node is read-only");
  }

  BlockCopyOptions o;
  o.cluster_size = gran;
  // buf-size bounds the data in flight; a chunk must fit in it.
  o.max_chunk = std::max(gran, std::min<uint64_t>(kBlockCopyDataChunk, align_down(buf, gran)));
  o.max_memory = std::max(buf, o.max_chunk);
  o.unmap_zeroes = p.unmap;
  o.speed = p.speed ? static_cast<uint64_t>(*p.speed) : 0;
  auto filter = std::make_shared<MirrorTop>(src->loop(), src, p.driver);
  if (!fname.empty()) filter->set_node_name(fname);
  filter->set_covering(stream);
  filter->set_commit(p.sync == MirrorJob::Sync::Commit);
  if (auto st = graph.insert_filter(src, filter); !st) {
    job->target_ref_.reset();
    mgr.early_fail(job);
    return st.take_error();
  }
  job->sync_ = p.sync;  // (the job's type names it in a conflict)
  if (p.overlay) p.overlay->set_backing_filtered(true);
  auto claims = claim_chain(std::string(job->type()) + " job '" + job->id() + "'", graph, src, tgt, p);
  if (!claims) {
    if (p.overlay) p.overlay->set_backing_filtered(false);
    graph.remove_filter(filter, src);
    job->target_ref_.reset();
    mgr.early_fail(job);
    return claims.take_error();
  }
  job->chain_claims_ = std::move(*claims);
  job->graph_ = &graph;
  job->source_ = src;
  job->target_ = tgt;
  job->filter_ = filter;
  job->bcs_ = std::make_unique<BlockCopyState>(*src, *tgt, o);
  job->sync_ = p.sync;
  job->new_backing_ = p.new_backing;
  job->overlay_ = p.overlay;
  job->backing_str_ = p.backing_str;
  job->target_backing_ = p.target_backing;
  job->owns_target_ = p.owns_target;
  job->write_blocking_ = p.write_blocking;
  job->on_source_error_ = p.on_source_error;
  job->on_target_error_ = p.on_target_error;
  job->speed_ = o.speed;
  mgr.block(src.get(), job->type());
  if (tgt != src) mgr.block(tgt.get(), job->type());
  job->start();
  return job;
}

}  // namespace vblk
