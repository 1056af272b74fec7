// Malformed rings and messages (vhost_user_hostile.h).
#include "vhost_user_hostile.h"

#include <chrono>
#include <cstring>
#include <thread>

namespace vhu {

using json = nlohmann::ordered_json;

const std::vector<HostileKind>& hostile_kinds() {
  static const std::vector<HostileKind> kKinds = {
      {"desc-addr-out-of-range", "a read whose data descriptor's address is in no memory region"},
      {"desc-len-past-region", "a read whose data buffer starts inside a region and runs past its end"},
      {"desc-loop", "a write whose two device-readable descriptors point at each other"},
      {"next-out-of-range", "a descriptor whose next is beyond the queue size"},
      {"head-out-of-range", "an avail ring entry beyond the queue size"},
      {"indirect-out-of-range", "an indirect table at an address in no region"},
      {"indirect-nested", "an indirect table whose entry is itself indirect"},
      {"indirect-bad-len", "an indirect descriptor whose length is not a multiple of 16"},
      {"queue-size-zero", "SET_VRING_NUM 0, then a request"},
      {"avail-idx-jump", "the avail index moved by more than the queue size"},
      {"read-into-readonly", "a read (IN) whose data descriptor is device-readable"},
      {"write-from-writable", "a write (OUT) whose data descriptor is device-writable"},
      {"header-too-short", "a request header of 8 bytes instead of 16"},
      {"no-writable-status", "a write whose descriptors are all device-readable (no status byte)"},
      {"zero-length-desc", "a read whose data descriptor has length 0"},
      {"writable-before-readable", "a device-writable descriptor before the readable header"},
      {"msg-unknown-request", "message type 99 with need_reply set"},
      {"msg-oversize", "a message header announcing a 64 KiB payload"},
      {"msg-bad-vring-index", "SET_VRING_CALL for queue 200"},
      {"msg-mem-table-no-fd", "SET_MEM_TABLE with one region and no fd"},
  };
  return kKinds;
}

namespace {

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The guest memory of one malformed request: header, data, status.
struct Bufs {
  GuestMemory::Block hdr, data, status, table, table2;
};

void header(Bufs& b, uint32_t type, uint64_t sector) {
  std::memset(b.hdr.host, 0, 16);
  std::memcpy(b.hdr.host, &type, 4);
  std::memcpy(b.hdr.host + 8, &sector, 8);
  b.status.host[0] = 0xff;
}

// Waits for the device to use an element or drop the connection.
void await_outcome(Device& d, Virtqueue& vq, const Bufs& b, int timeout_ms, json& r) {
  int64_t end = now_ms() + timeout_ms;
  uint16_t start = vq.last_used();
  for (;;) {
    if (vq.used_idx() != start) {
      auto [id, len] = vq.used_elem(start);
      r["outcome"] = "reply";
      r["used_id"] = id;
      r["used_len"] = len;
      uint8_t st = b.status.host ? b.status.host[0] : 0xff;
      r["status"] = st == 0xff ? json("unwritten") : json(status_name(st));
      return;
    }
    if (d.channel().closed(20)) {
      r["outcome"] = "disconnect";
      return;
    }
    if (now_ms() >= end) {
      r["outcome"] = "no_reply";
      return;
    }
  }
}

void message_outcome(Device& d, uint32_t request, int timeout_ms, json& r) {
  try {
    Message m = d.channel().recv(timeout_ms);
    r["outcome"] = "reply";
    r["reply_request"] = m.request;
    r["reply_flags"] = m.flags;
    if (m.payload.size() == 8) r["reply_u64"] = m.u64();
    r["reply_size"] = m.payload.size();
    (void)request;
  } catch (const Timeout&) {
    r["outcome"] = "no_reply";
  } catch (const Disconnected&) {
    r["outcome"] = "disconnect";
  }
}

void probe_alive(Device& d, json& r) {
  try {
    d.channel().send(kGetFeatures, {});
    Message m = d.channel().recv(2000);
    r["still_responds"] = m.request == kGetFeatures;
  } catch (const Disconnected&) {
    r["still_responds"] = false;
    r["disconnect_on_probe"] = true;
  } catch (const ProtocolError&) {
    r["still_responds"] = false;
  }
}

// A new client on the same socket, one 4 KiB read at 0.
void probe_recovery(const std::string& socket, const Options& base, json& r) {
  Options o;
  o.queues = 1;
  o.mem_regions = base.mem_regions;
  o.connect_timeout_ms = 5000;
  o.reply_timeout_ms = 5000;
  try {
    Device d(o);
    d.connect(socket);
    auto buf = d.mem().alloc(4096, 4096);
    BlkRequest req;
    req.type = kBlkIn;
    req.data = d.segs(buf, true);
    d.submit(0, req, 1);
    d.kick(0);
    if (!d.wait(5000)) {
      r["recovered"] = false;
      r["recovery_error"] = "no completion";
      return;
    }
    std::vector<Completion> c;
    d.reap(c);
    r["recovered"] = !c.empty() && c[0].status == kBlkOk;
  } catch (const ProtocolError& e) {
    r["recovered"] = false;
    r["recovery_error"] = e.what();
  }
}

}  // namespace

json run_hostile(const std::string& socket, const std::string& kind, const Options& opts, int timeout_ms) {
  json r;
  r["kind"] = kind;
  Options o = opts;
  o.queues = 1;
  if (kind == "queue-size-zero") o.vring_num = 0;
  Device d(o);
  try {
    d.connect(socket);
  } catch (const Disconnected& e) {
    r["outcome"] = "disconnect";
    r["during"] = "setup";
    r["error"] = e.what();
    probe_recovery(socket, opts, r);
    return r;
  } catch (const ProtocolError& e) {
    r["outcome"] = "refused";
    r["during"] = "setup";
    r["error"] = e.what();
    d.close();
    probe_recovery(socket, opts, r);
    return r;
  }
  r["event_idx"] = d.has(kFEventIdx);
  r["reply_ack"] = d.has_protocol(kPfReplyAck);

  GuestMemory& mem = d.mem();
  Virtqueue& vq = d.queue(0);
  uint16_t n = vq.size();
  Bufs b;
  b.hdr = mem.alloc(16, 64, 0);
  b.status = mem.alloc(1, 64, 0);
  b.data = mem.alloc(4096, 4096, static_cast<int>(mem.regions().size()) - 1);
  b.table = mem.alloc(16 * 4, 64, 0);
  b.table2 = mem.alloc(16 * 4, 64, 0);
  VringDesc* desc = vq.desc_table();
  auto set = [&](uint16_t i, uint64_t addr, uint32_t len, uint16_t flags, uint16_t next) {
    desc[i] = VringDesc{addr, len, flags, next};
  };
  auto tset = [](const GuestMemory::Block& t, int i, uint64_t addr, uint32_t len, uint16_t flags, uint16_t next) {
    reinterpret_cast<VringDesc*>(t.host)[i] = VringDesc{addr, len, flags, next};
  };
  header(b, kBlkIn, 0);
  bool message_kind = kind.rfind("msg-", 0) == 0;
  try {
    if (message_kind) {
      if (kind == "msg-unknown-request") {
        d.channel().send(99, {}, {}, kVersion | kNeedReplyFlag);
      } else if (kind == "msg-oversize") {
        uint8_t hdr[12];
        uint32_t req = kSetFeatures, flags = kVersion, size = 65536;
        std::memcpy(hdr, &req, 4);
        std::memcpy(hdr + 4, &flags, 4);
        std::memcpy(hdr + 8, &size, 4);
        d.channel().send_raw(std::span<const uint8_t>(hdr, 12));
      } else if (kind == "msg-bad-vring-index") {
        uint64_t v = 200;
        int f = vq.call_fd();
        d.channel().send(kSetVringCall, std::span<const uint8_t>(reinterpret_cast<uint8_t*>(&v), 8),
                         std::span<const int>(&f, 1), kVersion | kNeedReplyFlag);
      } else if (kind == "msg-mem-table-no-fd") {
        std::vector<uint8_t> t = mem.mem_table();
        uint32_t one = 1;
        std::memcpy(t.data(), &one, 4);
        t.resize(8 + 32);
        d.channel().send(kSetMemTable, t, {}, kVersion | kNeedReplyFlag);
      }
      message_outcome(d, 0, timeout_ms, r);
    } else {
      uint16_t a = vq.alloc_desc(), b1 = vq.alloc_desc(), c = vq.alloc_desc();
      uint16_t head = a;
      bool push = true;
      const GuestMemory::Region& r0 = mem.regions()[0];
      if (kind == "desc-addr-out-of-range") {
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, mem.unmapped_gpa(), 4096, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else if (kind == "desc-len-past-region") {
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, r0.gpa + r0.size - 512, 8192, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else if (kind == "desc-loop") {
        header(b, kBlkOut, 0);
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext, a);
      } else if (kind == "next-out-of-range") {
        set(a, b.hdr.gpa, 16, kDescNext, static_cast<uint16_t>(n + 7));
      } else if (kind == "head-out-of-range") {
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
        head = static_cast<uint16_t>(n + 3);
      } else if (kind == "indirect-out-of-range") {
        set(a, mem.unmapped_gpa(), 48, kDescIndirect, 0);
      } else if (kind == "indirect-nested") {
        tset(b.table2, 0, b.hdr.gpa, 16, kDescNext, 1);
        tset(b.table2, 1, b.data.gpa, 4096, kDescNext | kDescWrite, 2);
        tset(b.table2, 2, b.status.gpa, 1, kDescWrite, 0);
        tset(b.table, 0, b.table2.gpa, 48, kDescIndirect, 0);
        set(a, b.table.gpa, 16, kDescIndirect, 0);
      } else if (kind == "indirect-bad-len") {
        tset(b.table, 0, b.hdr.gpa, 16, kDescNext, 1);
        tset(b.table, 1, b.data.gpa, 4096, kDescNext | kDescWrite, 2);
        tset(b.table, 2, b.status.gpa, 1, kDescWrite, 0);
        set(a, b.table.gpa, 40, kDescIndirect, 0);
      } else if (kind == "queue-size-zero") {
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else if (kind == "avail-idx-jump") {
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
        for (uint16_t i = 0; i < n; i++) vq.push_avail(a);
        vq.set_avail_idx(static_cast<uint16_t>(n + 5));
        push = false;
      } else if (kind == "read-into-readonly") {
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else if (kind == "write-from-writable") {
        header(b, kBlkOut, 0);
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else if (kind == "header-too-short") {
        set(a, b.hdr.gpa, 8, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else if (kind == "no-writable-status") {
        header(b, kBlkOut, 0);
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 4096, kDescNext, c);
        set(c, b.status.gpa, 1, 0, 0);
      } else if (kind == "zero-length-desc") {
        set(a, b.hdr.gpa, 16, kDescNext, b1);
        set(b1, b.data.gpa, 0, kDescNext | kDescWrite, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else if (kind == "writable-before-readable") {
        set(a, b.data.gpa, 4096, kDescNext | kDescWrite, b1);
        set(b1, b.hdr.gpa, 16, kDescNext, c);
        set(c, b.status.gpa, 1, kDescWrite, 0);
      } else {
        r["outcome"] = "unknown_kind";
        return r;
      }
      if (push) {
        vq.push_avail(head);
        vq.set_avail_idx(static_cast<uint16_t>(vq.avail_idx() + 1));
      }
      vq.kick();
      await_outcome(d, vq, b, timeout_ms, r);
    }
  } catch (const Disconnected&) {
    r["outcome"] = "disconnect";
  } catch (const ProtocolError& e) {
    r["outcome"] = "error";
    r["error"] = e.what();
  }
  if (r["outcome"] != "disconnect") probe_alive(d, r);
  d.close();
  probe_recovery(socket, opts, r);
  return r;
}

}  // namespace vhu
