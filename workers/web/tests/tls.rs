//! HTTPS pages: a page served with a certificate from a test CA is read
//! when the operator trusts that CA (`extraCaFile`) and refused when not.
//! The certificates are made with `openssl` (scripts/ensure-servers
//! installs it).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use toolfleet_worker::TestCtx;
use toolfleet_worker::protocol::tools::load_file;
use toolfleet_worker::settings::SettingsFile;
use toolfleet_worker_web::net::{SystemResolver, TcpDialer};
use toolfleet_worker_web::tools::ReadPage;

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl (scripts/ensure-servers installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA and a server certificate for 127.0.0.1 signed by it.
fn certificates(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=toolfleet test CA",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=127.0.0.1",
        ],
    );
    std::fs::write(
        dir.join("ext.cnf"),
        "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
         extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "ext.cnf",
        ],
    );
}

/// An HTTPS server answering every request with one small page.
async fn https_page(dir: &Path) -> SocketAddr {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("server.pem"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match tls.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let body = "<html><head><title>Secure bees</title></head><body><p>Over TLS.</p></body></html>";
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = tls.write_all(response.as_bytes()).await;
                let _ = tls.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn https_pages_are_read_only_with_a_trusted_certificate() {
    let dir = tempfile::tempdir().unwrap();
    certificates(dir.path());
    let site = https_page(dir.path()).await;
    let def = load_file(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tool_definitions/web.read_page.json"),
    )
    .unwrap();
    let url = format!("https://127.0.0.1:{}/", site.port());
    let tool = |extra: &str| {
        let settings = format!(
            "[\"web:read_page\"]\nallowHosts = [\"127.0.0.1:{}\"]\n{extra}",
            site.port()
        );
        let s = SettingsFile::parse(&settings)
            .unwrap()
            .tool(&def, &BTreeMap::new())
            .unwrap();
        ReadPage::new(&def, &s, Arc::new(SystemResolver), Arc::new(TcpDialer)).unwrap()
    };
    let ctx = TestCtx::new();

    let trusted = tool(&format!(
        "extraCaFile = \"{}\"\n",
        dir.path().join("ca.pem").display()
    ));
    let out = ctx
        .call_checked(&def, &trusted, json!({"url": url}))
        .await
        .unwrap();
    // The title is untrusted too: it sits inside the fence.
    assert!(out.content.starts_with("[doc:1] "), "{}", out.content);
    assert!(
        out.content.contains("Title: Secure bees"),
        "{}",
        out.content
    );
    assert!(out.content.contains("Over TLS."));

    // The system's roots do not know the test CA.
    let untrusted = tool("");
    let e = ctx
        .call_checked(&def, &untrusted, json!({"url": url}))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("TLS with 127.0.0.1 failed"), "{e}");
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
}
