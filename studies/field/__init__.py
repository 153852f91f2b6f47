"""The field audit (issue 55): kvlab's audits run on real stores, each in an environment with its own pins."""
