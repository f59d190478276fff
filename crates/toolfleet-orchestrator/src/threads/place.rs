//! [`Place`]: the dispatcher's in-flight permit a run holds, given back
//! while the job only waits — for its thread (`super::Seat::enter`), or
//! for the first job of its idempotency key (`intake::idempotency`) — and
//! taken again before it runs. Waiting while holding it would let a line
//! of waiting jobs fill every place, and with `--max-in-flight 1` keep the
//! job they wait for from ever running.

use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A run's in-flight permit, when its dispatcher gave it one.
#[derive(Debug, Default)]
pub struct Place {
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    /// Its semaphore, kept while the permit is given back.
    semaphore: Mutex<Option<Arc<Semaphore>>>,
}

impl Place {
    /// The place holding `permit` (none: the run holds no permit).
    pub(crate) fn holding(permit: Option<OwnedSemaphorePermit>) -> Arc<Self> {
        let semaphore = permit.as_ref().map(|p| p.semaphore().clone());
        Arc::new(Self {
            permit: Mutex::new(permit),
            semaphore: Mutex::new(semaphore),
        })
    }

    /// Gives the permit back while the job waits (other jobs run
    /// meanwhile).
    pub(crate) fn give_back(&self) {
        drop(self.permit.lock().unwrap_or_else(|e| e.into_inner()).take());
    }

    /// Takes a permit again (waiting like any job for a free one), unless
    /// the run holds one or never had one.
    pub(crate) async fn take_again(&self) {
        if self
            .permit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return;
        }
        let semaphore = self
            .semaphore
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(semaphore) = semaphore
            && let Ok(permit) = semaphore.acquire_owned().await
        {
            *self.permit.lock().unwrap_or_else(|e| e.into_inner()) = Some(permit);
        }
    }

    /// Whether the run holds its permit now.
    #[cfg(test)]
    fn held(&self) -> bool {
        self.permit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_place_given_back_frees_the_permit_and_is_taken_again() {
        let semaphore = Arc::new(Semaphore::new(1));
        let place = Place::holding(Some(semaphore.clone().acquire_owned().await.unwrap()));
        assert_eq!(semaphore.available_permits(), 0);
        place.give_back();
        assert_eq!(semaphore.available_permits(), 1);
        place.take_again().await;
        assert!(place.held());
        assert_eq!(semaphore.available_permits(), 0);
        // Taking it again while held takes no second permit.
        place.take_again().await;
        let none = Place::holding(None);
        none.give_back();
        none.take_again().await;
        assert!(!none.held());
    }
}
