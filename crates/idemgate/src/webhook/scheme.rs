//! The constructors the schemes keyed by their secrets alone share.

/// Writes `new`, `secret_env` and `policy` for a scheme whose fields are `secrets` (and
/// `tolerance`, with `timestamp = "<header>"`, which adds the `tolerance` setter too).
macro_rules! secret_scheme {
    ($scheme:ident, $provider:ident) => {
        impl $scheme {
            /// Checks signatures made with any of `secrets`.
            pub fn new(secrets: impl Into<$crate::webhook::Secrets>) -> Self {
                Self {
                    secrets: secrets.into(),
                }
            }
            $crate::webhook::scheme::secret_scheme!(@shared $provider);
        }
    };
    ($scheme:ident, $provider:ident, timestamp = $header:literal) => {
        impl $scheme {
            /// Checks signatures made with any of `secrets`, timestamps within 5 minutes
            /// ([`DEFAULT_TOLERANCE`](crate::webhook::DEFAULT_TOLERANCE)).
            pub fn new(secrets: impl Into<$crate::webhook::Secrets>) -> Self {
                Self {
                    secrets: secrets.into(),
                    tolerance: $crate::webhook::DEFAULT_TOLERANCE,
                }
            }

            #[doc = concat!("How far `", $header, "` may be from the receiver's clock, either way.")]
            #[must_use]
            pub fn tolerance(mut self, tolerance: std::time::Duration) -> Self {
                self.tolerance = tolerance;
                self
            }
            $crate::webhook::scheme::secret_scheme!(@shared $provider);
        }
    };
    (@shared $provider:ident) => {
        /// Checks signatures made with the secrets held by these environment variables (a
        /// variable that is not set, or empty, is an error naming it).
        pub fn secret_env<N: AsRef<str>>(
            names: impl IntoIterator<Item = N>,
        ) -> Result<Self, $crate::webhook::SetupError> {
            $crate::webhook::Secrets::from_env(names).map(Self::new)
        }

        #[doc = concat!("[`Provider::", stringify!($provider), "`](crate::webhook::Provider::", stringify!($provider), ")'s route setup, verified by this.")]
        pub fn policy(self) -> $crate::RoutePolicy {
            $crate::webhook::Provider::$provider.policy().verify_with(self)
        }
    };
}

pub(crate) use secret_scheme;
