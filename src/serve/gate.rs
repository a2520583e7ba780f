//! The gate in front of the Flight SQL service: every call but `Handshake` must carry a
//! bearer token the [`Authenticator`] knows, else it is answered `Unauthenticated` before it
//! reaches the service. The caller it proved to be rides along in the request's extensions
//! ([`Caller`]), where the service reads whose session a call belongs to.

use std::task::{Context, Poll};

use super::credentials::{Authenticator, Caller, Credential};

/// The gRPC path of the one call that may come without a token.
const HANDSHAKE_PATH: &str = "/arrow.flight.protocol.FlightService/Handshake";

/// A tower layer that puts an [`AuthGate`] around a service.
#[derive(Clone)]
pub struct AuthLayer {
    auth: Authenticator,
}

impl AuthLayer {
    /// Admit the callers `auth` knows.
    pub fn new(auth: Authenticator) -> Self {
        Self { auth }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = AuthGate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthGate {
            inner,
            auth: self.auth.clone(),
        }
    }
}

/// Refuses calls without a known bearer token (see the module docs).
#[derive(Clone)]
pub struct AuthGate<S> {
    inner: S,
    auth: Authenticator,
}

impl<S, B> tower::Service<http::Request<B>> for AuthGate<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::Either<
        S::Future,
        futures::future::Ready<Result<Self::Response, Self::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        if request.uri().path() == HANDSHAKE_PATH {
            return futures::future::Either::Left(self.inner.call(request));
        }
        let presented = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(Credential::parse);
        let caller: Option<Caller> = match &presented {
            Some(Credential::Bearer(token)) => self.auth.caller(token),
            _ => None,
        };
        match caller {
            Some(caller) => {
                request.extensions_mut().insert(caller);
                futures::future::Either::Left(self.inner.call(request))
            }
            None => {
                let why = if presented.is_some() {
                    "an unknown or wrong token"
                } else {
                    "no token"
                };
                log::warn!(
                    "flumen serve refused a call to {}: {why}",
                    request.uri().path()
                );
                let status = tonic::Status::unauthenticated(format!(
                    "flumen serve: {why}; authenticate with the handshake (user and \
                     password) or present the server's token as 'authorization: Bearer ...'"
                ));
                futures::future::Either::Right(futures::future::ready(Ok(status.into_http())))
            }
        }
    }
}
