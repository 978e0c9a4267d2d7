//! The kernel's errors: each says what failed and what to do.

/// What can stop the kernel from starting or serving.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The connection file could not be read or parsed.
    #[error("failed to read the connection file {path}: {why}")]
    ConnectionFile {
        /// The file named on the command line.
        path: String,
        /// What was wrong with it.
        why: String,
    },
    /// A ZeroMQ socket could not be made or bound.
    #[error("failed to set up the {socket} socket on {endpoint}: {why} (is the port taken? start the kernel with a fresh connection file)")]
    Socket {
        /// shell, control, stdin, iopub or hb.
        socket: &'static str,
        /// The endpoint it was bound to.
        endpoint: String,
        /// libzmq's words.
        why: String,
    },
    /// A message could not be sent or received.
    #[error("failed to {what} on the {socket} socket: {why}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Which socket.
        socket: &'static str,
        /// libzmq's words.
        why: String,
    },
    /// The service refused to open the kernel's session.
    #[error("failed to open the kernel's R session: {0}")]
    Session(String),
    /// A kernelspec could not be written.
    #[error("failed to install the kernelspec in {dir}: {why}")]
    Install {
        /// The kernelspec's directory.
        dir: String,
        /// What went wrong.
        why: String,
    },
}
