//! Placeholder: written by its owner.
