//! Scheduled chat jobs and `notBefore` against real servers (issue 32).

mod support;
