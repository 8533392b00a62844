//! VCMP protocol core (sans-IO). See issue 3.
