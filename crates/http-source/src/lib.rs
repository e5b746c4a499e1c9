//! The webhook source: HTTP listener, auth schemes, body decoding and endpoints.
