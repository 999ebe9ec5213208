//! The phones' shared core (DESIGN.md section 8): API client, sync, SQLite cache, device keys, approvals, deep
//! links and push routing. No UI; the apps reach it through `loams-ffi`.
