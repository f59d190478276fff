//! A TCP proxy on a free loopback port in front of a real server, for
//! network faults a process cannot cause by itself: [`Proxy::cut`] drops
//! every connection through it at once (as a broken link does), and
//! [`Proxy::refuse`] turns new connections away until
//! [`Proxy::admit`] (a partition that lasts), and [`Proxy::cut_one`]
//! drops the oldest connection alone. The servers behind it and the
//! clients not using it see nothing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// The connections through a proxy, oldest first: each ends when its
/// sender is used or dropped.
type Live = Arc<Mutex<Vec<oneshot::Sender<()>>>>;

/// A proxy to one server; it stops (and drops its connections) on drop.
pub struct Proxy {
    addr: SocketAddr,
    live: Live,
    refusing: Arc<AtomicBool>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `target` (`host:port`) on a free loopback port,
    /// on the current tokio runtime.
    pub async fn start(target: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let live = Live::default();
        let refusing = Arc::new(AtomicBool::new(false));
        let accept = tokio::spawn(accept_loop(
            listener,
            target.to_string(),
            live.clone(),
            refusing.clone(),
        ));
        Ok(Self {
            addr,
            live,
            refusing,
            accept,
        })
    }

    /// The proxy's port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `scheme://127.0.0.1:<port>`: a URL for clients to use the proxy.
    #[must_use]
    pub fn url(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }

    /// Drops every connection through the proxy now (each side sees its
    /// socket closed); new ones are let through unless refused.
    pub fn cut(&self) {
        let cut: Vec<_> = self.live.lock().unwrap().drain(..).collect();
        for end in cut {
            let _ = end.send(());
        }
    }

    /// Drops the oldest connection still through the proxy (one broken
    /// link among several); the others carry on.
    pub fn cut_one(&self) {
        let mut live = self.live.lock().unwrap();
        while !live.is_empty() {
            if live.remove(0).send(()).is_ok() {
                return;
            }
        }
    }

    /// Turns every new connection away (accepted, then closed at once)
    /// until [`Proxy::admit`]; connections already through stay.
    pub fn refuse(&self) {
        self.refusing.store(true, Ordering::SeqCst);
    }

    /// Lets new connections through again.
    pub fn admit(&self) {
        self.refusing.store(false, Ordering::SeqCst);
    }

    /// [`Proxy::refuse`] then [`Proxy::cut`]: the server is out of reach
    /// through the proxy until [`Proxy::admit`].
    pub fn partition(&self) {
        self.refuse();
        self.cut();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

async fn accept_loop(listener: TcpListener, target: String, live: Live, refusing: Arc<AtomicBool>) {
    while let Ok((inbound, _)) = listener.accept().await {
        if refusing.load(Ordering::SeqCst) {
            drop(inbound);
            continue;
        }
        let (end, cut) = oneshot::channel();
        {
            let mut live = live.lock().unwrap();
            // Connections that ended on their own go.
            live.retain(|end| !end.is_closed());
            live.push(end);
        }
        let target = target.clone();
        tokio::spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(&target).await else {
                return;
            };
            let mut inbound = inbound;
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            tokio::select! {
                _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                _ = cut => {}
            }
            // Dropped: both sockets close.
        });
    }
}
