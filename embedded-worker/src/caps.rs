//! capget(2)/capset(2)'s structures, and running a step without
//! CAP_SYS_ADMIN in the effective set.

/// `struct __user_cap_header_struct` of capset(2).
#[repr(C)]
pub struct CapHeader {
    pub version: u32,
    pub pid: libc::c_int,
}

/// `struct __user_cap_data_struct` of capset(2).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CapData {
    pub effective: u32,
    pub permitted: u32,
    pub inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit halves of each set.
pub const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// Runs `f` with CAP_SYS_ADMIN out of this thread's effective set (back
/// after, if it was there): what `f` opens is opened as by a process
/// without it (`/proc/self/pagemap` then shows no physical addresses).
pub fn without_sys_admin<T>(f: impl FnOnce() -> T) -> T {
    const SYS_ADMIN: u32 = 1 << 21; // CAP_SYS_ADMIN
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget fills two CapData (version 3) for this thread.
    let got = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } == 0;
    let had = got && data[0].effective & SYS_ADMIN != 0;
    if had {
        let mut less = data;
        less[0].effective &= !SYS_ADMIN;
        // SAFETY: capset with the sets capget gave, one bit fewer.
        unsafe { libc::syscall(libc::SYS_capset, &mut header, less.as_ptr()) };
    }
    let out = f();
    if had {
        // SAFETY: capset back to the sets capget gave (the bit is still
        // in the permitted set, so it may be raised again).
        unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    }
    out
}
