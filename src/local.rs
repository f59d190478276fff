//! local (in progress)
