"""The seccomp filter every bwrap sandbox runs under: the kernel's key management is closed to it.

Every sandbox of a host runs as the same uid (`SANDBOX_UID` as root, the calling user otherwise), and
the kernel keeps one user keyring (`@u`) per uid, shared by all of that uid's processes and kept after
they exit. A rollout could leave a key there for a later rollout to read (or, not as root, read the
host user's own keys). So `add_key`, `request_key` and `keyctl` fail with EPERM, as under Docker's
default profile and flatpak; nothing else is filtered.

The filter is a classic BPF program (`struct sock_filter`) written here by hand, so that no seccomp
library is needed; bwrap loads it (`--seccomp FD`) right before it starts the command, and every
process of the sandbox inherits it. It checks `seccomp_data.arch`, so that a 32-bit process (int 0x80
on x86_64, AArch32 on aarch64) is judged by its own syscall numbers, and on x86_64 it refuses every
x32 syscall (numbers from 0x40000000), as Docker does. A syscall of any other architecture fails.

Guaranteed (on x86_64 and aarch64 hosts): no sandboxed process can add, find, read or change a key.
Not guaranteed: on another architecture no filter is made (`program()` returns None, the backend logs
it once and leaves "keyring" out of `Sandbox.enforced`); the keyring is then shared as described above.
"""

from __future__ import annotations

import errno
import platform
import struct

# linux/audit.h
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
AUDIT_ARCH_AARCH64 = 0xC00000B7
AUDIT_ARCH_ARM = 0x40000028
X32_SYSCALL_BIT = 0x40000000

# (arch, add_key, request_key, keyctl) per ABI a process of the host may use (each arch's unistd.h).
ABIS = {
    "x86_64": [(AUDIT_ARCH_X86_64, (248, 249, 250)), (AUDIT_ARCH_I386, (286, 287, 288))],
    "aarch64": [(AUDIT_ARCH_AARCH64, (217, 218, 219)), (AUDIT_ARCH_ARM, (309, 310, 311))],
}
ABIS["amd64"] = ABIS["x86_64"]
ABIS["arm64"] = ABIS["aarch64"]

# linux/filter.h, linux/bpf_common.h, linux/seccomp.h
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...

DENIED = ("add_key", "request_key", "keyctl")
ERRNO = errno.EPERM


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter, in the host's byte order


def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this host's `platform.machine()`), as the bytes bwrap reads
    from `--seccomp FD`; None for an architecture whose syscall numbers are not listed here."""
    abis = ABIS.get(machine or platform.machine())
    if abis is None:
        return None
    deny = _insn(_RET_K, 0, 0, _RET_ERRNO | ERRNO)
    out = [_insn(_LD_W_ABS, 0, 0, _OFFSET_ARCH)]
    for arch, numbers in abis:
        # The block of one ABI: load nr, deny the listed numbers (and x32's), allow the rest. Each jump
        # is relative to the next instruction; the block ends with its own deny.
        block = [_insn(_LD_W_ABS, 0, 0, _OFFSET_NR)]
        checks = [(_JGE_K, X32_SYSCALL_BIT)] if arch == AUDIT_ARCH_X86_64 else []
        checks += [(_JEQ_K, nr) for nr in numbers]
        for i, (code, k) in enumerate(checks):
            # Past the remaining checks and the allow, onto the deny.
            block.append(_insn(code, len(checks) - i, 0, k))
        block += [_insn(_RET_K, 0, 0, _RET_ALLOW), deny]
        out.append(_insn(_JEQ_K, 0, len(block), arch))  # another arch: skip this block
        out += block
    out.append(deny)  # an architecture this host does not run
    return b"".join(out)
