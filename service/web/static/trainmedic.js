// trainmedic's pages: served by the service (the CSP allows no inline script).
// Re-fetch this page and swap in the parts marked data-refresh, keeping open records open
// (a meta refresh would close them and lose the reader's place).
(function () {
  // A link from another site (a chat, a notification) arrives without the SameSite=Strict login cookie, so
  // this page was made for nobody. Ask this site, which the browser sends the cookie to, whether this browser
  // is logged in; if so, open the page again from here, as that person.
  var check = document.body.dataset.sessionCheck;
  if (check) {
    fetch(check, {credentials: "same-origin", cache: "no-store"})
      .then(function (resp) { return resp.ok ? resp.json() : {}; })
      .then(function (state) { if (state.logged_in) location.replace(document.body.dataset.next || "/"); })
      .catch(function () {});
  }
  var box = document.getElementById("autorefresh"), stamp = document.getElementById("updated");
  if (!box) return;  // the login page: nothing to refresh or decide
  var every = parseInt(document.body.dataset.refreshSeconds || "10", 10) * 1000, busy = false;
  function refresh(force) {
    if (busy || (force !== true && (!box.checked || document.hidden))) return;
    busy = true;
    fetch(location.href, {cache: "no-store", headers: {"Accept": "text/html"}})
      .then(function (resp) { if (!resp.ok) throw new Error(resp.status); return resp.text(); })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var open = Array.prototype.map.call(document.querySelectorAll("details[open]"), function (d) { return d.id; });
        document.querySelectorAll("[data-refresh]").forEach(function (el) {
          var fresh = doc.getElementById(el.id);
          // Only what changed is redrawn, so a chart under the pointer stays put.
          if (fresh && fresh.innerHTML !== el.innerHTML) el.replaceWith(document.importNode(fresh, true));
        });
        open.forEach(function (id) { var d = document.getElementById(id); if (d) d.open = true; });
        stamp.textContent = "· updated " + new Date().toLocaleTimeString();
      })
      .catch(function () { stamp.textContent = "· refresh failed, retrying"; })
      .then(function () { busy = false; });
  }
  setInterval(refresh, every);
  // A link to #rec-ID (from the timeline) opens that record.
  function openLinked() {
    var d = location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (d && d.tagName === "DETAILS") d.open = true;
  }
  window.addEventListener("hashchange", openLinked);
  openLinked();

  // Approve and reject held records as the person logged in: the session cookie names them (it never holds the
  // token), and the session's CSRF value, which only this site's pages can read, goes in a header.
  document.addEventListener("click", function (ev) {
    var btn = ev.target.closest && ev.target.closest(".decide button");
    if (!btn) return;
    var box = btn.closest(".decide"), msg = box.querySelector(".decide-msg");
    var verb = btn.classList.contains("approve") ? "approve" : "reject";
    var who = document.querySelector("form.who[data-csrf]");
    if (!who) {
      var login = document.querySelector("a.who");
      msg.className = "decide-msg bad";
      msg.textContent = login ? "Not done: log in with your operator token first (" :
        "Not done: this service has no operator token, so approving from the pages is off.";
      if (login) {
        var link = document.createElement("a");
        link.href = login.href; link.textContent = "log in";
        msg.appendChild(link); msg.appendChild(document.createTextNode(")."));
      }
      return;
    }
    var comment = box.querySelector(".comment").value;
    box.querySelectorAll("button").forEach(function (b) { b.disabled = true; });
    msg.textContent = verb === "approve" ? "Approving…" : "Rejecting…"; msg.className = "decide-msg";
    fetch(box.dataset[verb], {method: "POST", credentials: "same-origin", cache: "no-store",
      headers: {"Content-Type": "application/json", "X-CSRF-Token": who.dataset.csrf},
      body: JSON.stringify(comment ? {comment: comment} : {})})
      .then(function (resp) {
        return resp.json().catch(function () { return {}; }).then(function (body) {
          if (!resp.ok) throw new Error(body.error || ("HTTP " + resp.status));
          msg.textContent = (verb === "approve" ? "Approved: " : "Rejected: ") + "the record is now " +
            String(body.status).replace(/_/g, " ") + ".";
          refresh(true);
        });
      })
      .catch(function (err) {
        msg.textContent = "Not done: " + err.message; msg.className = "decide-msg bad";
        box.querySelectorAll("button").forEach(function (b) { b.disabled = false; });
      });
  });
})();
