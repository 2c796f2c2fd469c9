//! The status page (`GET /dashboard`) and the JSON it refreshes from (`GET /admin/summary`).
