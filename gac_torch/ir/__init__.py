"""The gac dialect: definitions (IRDL), builders and the shape/dtype verifier."""
