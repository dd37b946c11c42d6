//! Signing secrets: held without ever being printed, one or several at once for rotation.

use std::fmt;
use std::sync::Arc;

/// Why a verifier could not be set up. Names the environment variable a secret came from,
/// never the secret.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A variable named for a secret is not set (or not valid Unicode).
    #[error("the environment variable {name} holds no webhook secret: it is not set")]
    MissingEnv {
        /// The variable's name.
        name: String,
    },
    /// A secret (or the variable it came from) is empty.
    #[error("the webhook secret {from} is empty")]
    EmptySecret {
        /// Where it came from: `the environment variable NAME` or `number N`.
        from: String,
    },
    /// No secret was given at all.
    #[error("no webhook secret was given; give one, or several while rotating")]
    NoSecret,
    /// A Standard Webhooks secret is not `whsec_` followed by base64.
    #[error("the webhook secret {from} is not valid base64 after its \"whsec_\" prefix")]
    InvalidBase64 {
        /// Where it came from.
        from: String,
    },
    /// A public URL (Twilio's) that cannot be the URL a sender signed.
    #[error("the public URL {url:?} is not valid: {why}")]
    InvalidPublicUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// One signing secret. Its `Debug` says where it came from and prints none of its bytes, so
/// a policy, a verifier or an error can be logged whole.
///
/// ```
/// use idemgate::webhook::Secret;
///
/// let secret = Secret::new("whsec_do_not_print");
/// assert!(!format!("{secret:?}").contains("do_not_print"));
/// ```
#[derive(Clone)]
pub struct Secret {
    bytes: Arc<[u8]>,
    /// The environment variable it was read from, if any.
    env: Option<Arc<str>>,
}

impl Secret {
    /// A secret given directly, as the provider shows it (its bytes are the key, except for
    /// Standard Webhooks, whose `whsec_` secrets are decoded when the verifier is made).
    pub fn new(secret: impl AsRef<[u8]>) -> Self {
        Self {
            bytes: Arc::from(secret.as_ref()),
            env: None,
        }
    }

    /// The secret held by the environment variable `name`.
    ///
    /// ```
    /// use idemgate::webhook::{Secret, SetupError};
    ///
    /// let missing = Secret::from_env("IDEMGATE_DOC_SURELY_UNSET");
    /// assert!(matches!(missing, Err(SetupError::MissingEnv { .. })));
    /// ```
    pub fn from_env(name: &str) -> Result<Self, SetupError> {
        let value = std::env::var(name).map_err(|_| SetupError::MissingEnv {
            name: name.to_owned(),
        })?;
        let secret = Self {
            bytes: Arc::from(value.as_bytes()),
            env: Some(Arc::from(name)),
        };
        if secret.bytes.is_empty() {
            return Err(SetupError::EmptySecret {
                from: secret.origin(0),
            });
        }
        Ok(secret)
    }

    /// The key bytes: only ever handed to a MAC.
    pub(crate) fn expose(&self) -> &[u8] {
        &self.bytes
    }

    /// Where the secret came from, for errors: its variable, or its place in the list.
    pub(crate) fn origin(&self, at: usize) -> String {
        match &self.env {
            Some(name) => format!("from the environment variable {name}"),
            None => format!("number {}", at + 1),
        }
    }

    /// The same origin, other bytes (a decoded form of this secret).
    pub(crate) fn with_bytes(&self, bytes: Vec<u8>) -> Self {
        Self {
            bytes: Arc::from(bytes),
            env: self.env.clone(),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("Secret");
        if let Some(name) = &self.env {
            s.field("env", name);
        }
        s.field("value", &format_args!("<redacted>")).finish()
    }
}

/// The secrets a route accepts: one, or several while one is being rotated out (a signature
/// made with any of them is accepted).
///
/// ```
/// use idemgate::webhook::Secrets;
///
/// # fn main() -> Result<(), idemgate::webhook::SetupError> {
/// let rotating = Secrets::new(["old-secret", "new-secret"])?;
/// assert_eq!(rotating.len(), 2);
/// assert!(!format!("{rotating:?}").contains("secret\""));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Secrets(Arc<[Secret]>);

impl Secrets {
    /// These secrets, given directly. None may be empty, and there must be at least one.
    pub fn new<S: AsRef<[u8]>>(secrets: impl IntoIterator<Item = S>) -> Result<Self, SetupError> {
        Self::from_list(secrets.into_iter().map(Secret::new).collect())
    }

    /// The secrets held by the environment variables `names`, in order; a variable that is
    /// not set, or empty, is an error naming it.
    ///
    /// ```
    /// use idemgate::webhook::{Secrets, SetupError};
    ///
    /// let refused = Secrets::from_env(["IDEMGATE_DOC_SURELY_UNSET"]).unwrap_err();
    /// assert_eq!(refused, SetupError::MissingEnv { name: "IDEMGATE_DOC_SURELY_UNSET".into() });
    /// ```
    pub fn from_env<N: AsRef<str>>(names: impl IntoIterator<Item = N>) -> Result<Self, SetupError> {
        let secrets = names
            .into_iter()
            .map(|name| Secret::from_env(name.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Self::from_list(secrets)
    }

    fn from_list(secrets: Vec<Secret>) -> Result<Self, SetupError> {
        if secrets.is_empty() {
            return Err(SetupError::NoSecret);
        }
        if let Some((at, empty)) = secrets.iter().enumerate().find(|(_, s)| s.bytes.is_empty()) {
            return Err(SetupError::EmptySecret {
                from: empty.origin(at),
            });
        }
        Ok(Self(secrets.into()))
    }

    /// How many secrets there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always `false`: there is at least one.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &Secret> {
        self.0.iter()
    }

    /// Each secret turned into another form by `decode`, which is told where it came from.
    pub(crate) fn try_map(
        &self,
        decode: impl Fn(&Secret, usize) -> Result<Secret, SetupError>,
    ) -> Result<Self, SetupError> {
        let decoded = self
            .iter()
            .enumerate()
            .map(|(at, secret)| decode(secret, at))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self(decoded.into()))
    }
}

impl From<Secret> for Secrets {
    fn from(secret: Secret) -> Self {
        Self(Arc::from([secret]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_errors_never_show_a_secret() {
        let secrets = Secrets::new(["s3cr3t-one", "s3cr3t-two"]).unwrap();
        let shown = format!("{secrets:?} {:?}", secrets.iter().next());
        assert!(!shown.contains("s3cr3t"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn no_secret_or_an_empty_one_is_refused() {
        assert_eq!(
            Secrets::new(Vec::<&str>::new()).unwrap_err(),
            SetupError::NoSecret
        );
        let empty = Secrets::new(["ok", ""]).unwrap_err();
        assert_eq!(
            empty,
            SetupError::EmptySecret {
                from: "number 2".into()
            }
        );
    }

    #[test]
    fn a_missing_variable_is_named() {
        let err = Secrets::from_env(["IDEMGATE_TEST_NO_SUCH_SECRET"]).unwrap_err();
        assert!(
            err.to_string().contains("IDEMGATE_TEST_NO_SUCH_SECRET"),
            "{err}"
        );
    }

    #[test]
    fn a_set_variable_is_read_and_its_name_shown_not_its_value() {
        // PATH is set wherever tests run; reading it changes nothing.
        let path = std::env::var("PATH").unwrap();
        let secrets = Secrets::from_env(["PATH"]).unwrap();
        let secret = secrets.iter().next().unwrap();
        assert_eq!(secret.expose(), path.as_bytes());
        let shown = format!("{secret:?}");
        assert!(shown.contains("PATH") && !shown.contains(&path), "{shown}");
    }
}
