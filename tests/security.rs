//! (tests land here)
