//! Names for the commands the broker counts and can fault on.
//!
//! Invariant: every request maps to exactly one [`RequestKind`]; codes the
//! broker does not implement map to [`RequestKind::Other`] with their code.

use iggy_binary_protocol::codes::{
    CREATE_STREAM_CODE, CREATE_TOPIC_CODE, GET_CLUSTER_METADATA_CODE, GET_STREAM_CODE, GET_TOPIC_CODE,
    LOGIN_REGISTER_CODE, LOGIN_REGISTER_WITH_PAT_CODE, LOGOUT_USER_CODE, PING_CODE, POLL_MESSAGES_CODE,
    SEND_MESSAGES_CODE,
};

/// A command of the binary protocol, as seen by the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RequestKind {
    /// Login (the register handshake that binds a session).
    Login,
    Logout,
    Ping,
    ClusterMetadata,
    GetStream,
    CreateStream,
    GetTopic,
    CreateTopic,
    SendMessages,
    PollMessages,
    /// Any other command code; the broker answers it with `FeatureUnavailable`.
    Other(u32),
}

impl RequestKind {
    /// The kind of a request carrying command `code`.
    #[must_use]
    pub fn from_code(code: u32) -> Self {
        match code {
            LOGIN_REGISTER_CODE | LOGIN_REGISTER_WITH_PAT_CODE => Self::Login,
            LOGOUT_USER_CODE => Self::Logout,
            PING_CODE => Self::Ping,
            GET_CLUSTER_METADATA_CODE => Self::ClusterMetadata,
            GET_STREAM_CODE => Self::GetStream,
            CREATE_STREAM_CODE => Self::CreateStream,
            GET_TOPIC_CODE => Self::GetTopic,
            CREATE_TOPIC_CODE => Self::CreateTopic,
            SEND_MESSAGES_CODE => Self::SendMessages,
            POLL_MESSAGES_CODE => Self::PollMessages,
            other => Self::Other(other),
        }
    }
}
