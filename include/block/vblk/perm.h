// Permissions: what the users of a node need from it and what they let
// others do at the same time — QEMU's BLK_PERM_* model, so that vblk takes
// the same image locks as QEMU for the same use and the two exclude each
// other exactly as two QEMUs do.
//
// Every node has a cumulative (perm, shared) pair: the union of what its
// users need and the intersection of what they share. Users are parent
// nodes (through Node::child_perm, which turns a parent's pair into what it
// needs of one child: a qcow2 node needs to write its file even when nobody
// writes the qcow2 node), re-pointable references (NodeRef: exports, jobs)
// and the claim of whoever opened the node (a CLI command, qemu-img's
// BlockBackend). A protocol node over a file turns its pair into OFD locks
// (block/drivers/file_lock.h).
//
// Plain values; no shared state.
#pragma once

#include <cstdint>
#include <string>

namespace vblk {

enum Perm : uint32_t {
  kPermConsistentRead = 1u << 0,  // reads see what was last written (not a moving target)
  kPermWrite = 1u << 1,           // may change what reads return
  kPermWriteUnchanged = 1u << 2,  // may write, but only data that reads the same
  kPermResize = 1u << 3,          // may change the length
  kPermAll = 0xfu,
};
inline constexpr int kPermBits = 4;

struct PermPair {
  uint32_t perm = 0;           // what is needed
  uint32_t shared = kPermAll;  // what others may do meanwhile
  bool operator==(const PermPair&) const = default;
};

// QEMU's bdrv_perm_names: "consistent read, write" for a mask.
std::string perm_names(uint32_t perms);

// Users of a node are checked against each other newest first, as QEMU
// walks a node's parent list (new parents go to its head), so that the
// same conflict is reported in the same words. A stamp orders them.
uint64_t next_user_stamp();

}  // namespace vblk
